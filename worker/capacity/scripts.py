"""The capacity scripts of a limited route (docs/design-capacity.md B.3): OFFER, ADMIT, ACQUIRE, RENEW, RELEASE;
and of a tenant's budget store (docs/capacity.md#budgets): RESERVE, EXTEND, SETTLE (their rule is by them).

Rule: every script takes the route's fixed KEYS (``RouteKeys.script_keys``: one hash tag, one Cluster slot),
reads the clock with ``redis.call('TIME')`` (ARGV[1] overrides it, for tests only; '' = TIME), starts by
expiring leases, permits and reservations past their time, reads the limits from ``state.limits`` (never from
ARGV: the fleet enforces one set), and is idempotent for its caller:

- ``OFFER`` (a read batch's jobs of one route) is keyed per job by request id: a lease with the job's token
  answers ``admitted`` again (and counts against the call's run slots again), a waiting job ``parked``, a
  lease with another token ``held``, a request whose custody ended lately (RELEASE final=1 marks it
  ``finished`` for the caller's window) ``done``: an OFFER re-sent after a lost reply, or a jobs entry
  delivered again, that lands after its job ran and finished admits nothing.
- ``ADMIT`` stores the ids it admitted in the admit memo of its call id (KEYS[16], TTL lease_ms): a call sent
  again with the same id returns the same jobs (still leased with those tokens) and admits nothing new. One
  memo per call, not per worker: a worker's concurrent handoffs cannot overwrite each other's.
- ``ACQUIRE`` is keyed by the attempt token: a permit already there answers ``ok`` without counting again.
- ``RENEW`` only moves expiries of what the caller still holds (ZADD XX), and names what it lost.
- ``RELEASE`` removes by token (a no-op the second time), settles tokens by the difference to what is stored
  (0 the second time), and raises the cooldown streak at most once per attempt token (``cooldown_by``).

The discipline (strict priority, then deficit round robin over tenants with per-tenant caps) is the one of
``tests.oracles.discipline``, which the tests hold this Lua to.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "ADMIT", "CLEAN_BATCH", "EXTEND", "OFFER", "RELEASE", "RENEW", "RESERVE", "SETTLE"]

# Shared by every script. KEYS (fixed order): state, held, lease, permits, reserved, rpm, tpm, tpm_cost,
# wait:interactive, wait:batch, waiting, ring:interactive, ring:batch, drr, finished, admit memo.
_PRELUDE = """
local K_STATE, K_HELD, K_LEASE, K_PERMITS, K_RESERVED = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_RPM, K_TPM, K_COST, K_WAITING, K_DRR = KEYS[6], KEYS[7], KEYS[8], KEYS[11], KEYS[14]
local K_FINISHED, K_MEMO = KEYS[15], KEYS[16]
local K_WAIT = {interactive = KEYS[9], batch = KEYS[10]}
local K_RING = {interactive = KEYS[12], batch = KEYS[13]}
local PRIOS = {'interactive', 'batch'}

local now
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local L = {c = 0, rpm = 0, tpm = 0, margin = 1000, cmin = 250, cmax = 30000, cbase = 1000, tenants = {}}
local raw_limits = redis.call('HGET', K_STATE, 'limits')
if raw_limits then
  for k, v in pairs(cjson.decode(raw_limits)) do L[k] = v end
end
local WINDOW = 60000 + L.margin

local function tenant_conf(t)
  local c = L.tenants[t] or L.tenants['*'] or {}
  return (c.w or 1), (c.c or 0)
end

local function requeue_lease(rid, raw)
  local l = cjson.decode(raw)
  redis.call('HDEL', K_LEASE, rid)
  redis.call('ZREM', K_HELD, rid)
  redis.call('HINCRBY', K_DRR, 'f:' .. l.tenant, -1)
  redis.call('ZADD', K_WAIT[l.priority], 0, l.member)
  redis.call('HSET', K_WAITING, rid, l.record)
  if redis.call('HINCRBY', K_DRR, 'n:' .. l.priority .. ':' .. l.tenant, 1) == 1 then
    redis.call('RPUSH', K_RING[l.priority], l.tenant)
  end
  redis.call('HINCRBY', K_STATE, 'expired', 1)
end

-- Leases past their expiry go back to their tenant's queue (first of it: the member keeps its queued_at);
-- permits and reservations past theirs (a dead worker's, a fallback attempt's) are dropped.
local function expire()
  local gone = redis.call('ZRANGEBYSCORE', K_HELD, '-inf', now, 'LIMIT', 0, 100)
  for _, rid in ipairs(gone) do
    local raw = redis.call('HGET', K_LEASE, rid)
    if raw then requeue_lease(rid, raw) else redis.call('ZREM', K_HELD, rid) end
  end
  redis.call('ZREMRANGEBYSCORE', K_PERMITS, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', K_RESERVED, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', K_FINISHED, '-inf', now)
end

local function trim_windows()
  local cut = now - WINDOW
  redis.call('ZREMRANGEBYSCORE', K_RPM, '-inf', cut)
  local old = redis.call('ZRANGEBYSCORE', K_TPM, '-inf', cut)
  if #old > 0 then
    local sum = 0
    for _, tok in ipairs(old) do
      sum = sum + tonumber(redis.call('HGET', K_COST, tok) or '0')
      redis.call('HDEL', K_COST, tok)
    end
    redis.call('ZREMRANGEBYSCORE', K_TPM, '-inf', cut)
    redis.call('HINCRBY', K_STATE, 'tpm_sum', -sum)
  end
end

local function oldest_plus_window(key)
  local o = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #o == 0 then return now + 1 end
  return tonumber(o[2]) + WINDOW
end

-- May one more attempt of `cost` tokens start now? nil, or the reason and when to look again.
-- `mine`: a reservation of the caller's, not counted against it.
local function refusal(cost, mine)
  local cu = tonumber(redis.call('HGET', K_STATE, 'cooldown_until') or '0')
  if cu > now then return 'cooldown', cu end
  if L.c > 0 then
    local used = redis.call('ZCARD', K_PERMITS) + redis.call('ZCARD', K_RESERVED)
    if mine and redis.call('ZSCORE', K_RESERVED, mine) then used = used - 1 end
    if used >= L.c then return 'concurrency', now + 250 end
  end
  if L.rpm > 0 and redis.call('ZCARD', K_RPM) >= L.rpm then return 'rate', oldest_plus_window(K_RPM) end
  if L.tpm > 0 then
    local sum = tonumber(redis.call('HGET', K_STATE, 'tpm_sum') or '0')
    if sum + cost > L.tpm then return 'tokens', oldest_plus_window(K_TPM) end
  end
  return nil
end

local function count_refusal(reason)
  if reason ~= 'tenant' then redis.call('HINCRBY', K_STATE, 'refused_' .. reason, 1) end
end

local function take_permit(tok, cost, lease_ms)
  redis.call('ZREM', K_RESERVED, tok)
  redis.call('ZADD', K_PERMITS, now + lease_ms, tok)
  redis.call('ZADD', K_RPM, now, tok)
  if L.tpm > 0 then
    redis.call('ZADD', K_TPM, now, tok)
    redis.call('HSET', K_COST, tok, cost)
    redis.call('HINCRBY', K_STATE, 'tpm_sum', cost)
  end
end

local function lease(rid, tok, worker, tenant, prio, member, record, cost, lease_ms)
  redis.call('HSET', K_LEASE, rid, cjson.encode({token = tok, worker = worker, tenant = tenant,
    priority = prio, member = member, record = record}))
  redis.call('ZADD', K_HELD, now + lease_ms, rid)
  redis.call('HINCRBY', K_DRR, 'f:' .. tenant, 1)
  redis.call('HINCRBY', K_STATE, 'admitted', 1)
  take_permit(tok, cost, lease_ms)
end

local function record_cost(record)
  return tonumber(cjson.decode(record).est_tokens) or 0
end

-- ADMIT: up to n waiting jobs, interactive before batch, deficit round robin over the tenants of a class.
-- Returns {retry_at, waiting_on, {rid, token, record}...}.
local function admit(call_id, worker, n, lease_ms)
  local memo = redis.call('GET', K_MEMO)
  if memo then
    local m = cjson.decode(memo)
    if m.id == call_id then  -- sent again after a lost reply: the same jobs, nothing new
      local out = {'0', ''}
      for i, rid in ipairs(m.rids) do
        local raw = redis.call('HGET', K_LEASE, rid)
        if raw then
          local l = cjson.decode(raw)
          if l.token == m.tokens[i] then table.insert(out, {rid, l.token, l.record}) end
        end
      end
      return out
    end
  end
  local got, rids, toks = {}, {}, {}
  local retry_at, waiting_on = 0, ''
  local blocked = false
  for _, prio in ipairs(PRIOS) do
    local ring, wq = K_RING[prio], K_WAIT[prio]
    local visits = 0
    while not blocked and #got < n do
      local len = redis.call('LLEN', ring)
      if len == 0 or visits > len + n then break end
      visits = visits + 1
      local t = redis.call('LINDEX', ring, 0)
      local w, cap = tenant_conf(t)
      local dkey, nkey, fkey = 'd:' .. prio .. ':' .. t, 'n:' .. prio .. ':' .. t, 'f:' .. t
      if cap > 0 and tonumber(redis.call('HGET', K_DRR, fkey) or '0') >= cap then
        redis.call('HDEL', K_DRR, dkey)  -- a capped tenant forfeits its turn
        redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
        if waiting_on == '' then waiting_on = 'tenant' end
      else
        local d = tonumber(redis.call('HGET', K_DRR, dkey) or '0')
        if d < 1 then d = w end  -- a new turn: one quantum, no credit hoarded past it
        local capped = false
        while d >= 1 and #got < n do
          local head = redis.call('ZRANGEBYLEX', wq, '[' .. string.format('%03d', #t) .. t,
            '(' .. string.format('%03d', #t) .. t .. '\\255', 'LIMIT', 0, 1)
          if #head == 0 then break end
          local member = head[1]
          local rid = string.sub(member, 3 + #t + 13 + 1)
          local record = redis.call('HGET', K_WAITING, rid) or '{}'
          local cost = record_cost(record)
          local reason, at = refusal(cost, nil)
          if reason then
            blocked, waiting_on, retry_at = true, reason, at
            count_refusal(reason)
            break
          end
          local tok = call_id .. '.' .. (#got + 1)
          redis.call('ZREM', wq, member)
          redis.call('HDEL', K_WAITING, rid)
          redis.call('HINCRBY', K_DRR, nkey, -1)
          lease(rid, tok, worker, t, prio, member, record, cost, lease_ms)
          table.insert(got, {rid, tok, record})
          table.insert(rids, rid)
          table.insert(toks, tok)
          d = d - 1
          if cap > 0 and tonumber(redis.call('HGET', K_DRR, fkey)) >= cap then capped = true; break end
        end
        if tonumber(redis.call('HGET', K_DRR, nkey) or '0') <= 0 then
          redis.call('HDEL', K_DRR, dkey, nkey)
          redis.call('LPOP', ring)
        elseif d < 1 or capped then
          redis.call('HDEL', K_DRR, dkey)
          redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
        else
          redis.call('HSET', K_DRR, dkey, d)  -- the turn goes on at the next call
        end
      end
    end
    if blocked then break end
  end
  redis.call('SET', K_MEMO, cjson.encode({id = call_id, rids = rids, tokens = toks}), 'PX', lease_ms)
  local out = {tostring(retry_at), waiting_on}
  for _, g in ipairs(got) do table.insert(out, g) end
  return out
end

expire()
trim_windows()
"""

# OFFER hands the jobs of one read batch (one job shard, one route) to the route, each as it comes: admitted
# now (a lease and its first attempt's permit) only while the caller's `slots` last, else parked.
# ARGV: now_override, worker, lease_ms, slots (the run slots the caller took for this call: it admits at most
#       that many, so no admission waits for a slot; a job past them is parked even when the route has room,
#       `waiting_on = worker` when nothing else holds it), n, group, route, then n jobs of 9 fields: request id,
#       token, tenant, priority, est_tokens, wait member, wait record, fallbacks (1: a cooling route answers
#       'cooldown' instead of parking it, and a slot left goes to its fallbacks; without one the caller waits for
#       one before trying them), jobs entry id
# KEYS: the route's (as every script), then, on a single instance only (one server holds every key), the
#       hand-over: the jobs' shard stream and each job's request status (KEYS[17 + i] for job i): a job's entry
#       is acked and a parked job's status written in the same step as the route takes custody (admitted,
#       parked, held or done), one round trip and no window between them; on a Cluster (more slots) the caller
#       does both after the reply.
# Returns one reply per job, in order: {'admitted', token} | {'parked', waiting_on, retry_at} | {'held'} | {'done'}
#       | {'cooldown', until, slot ('1': one of `slots` went to it, '0': none was left)} | {'too_large'}
# Sent again after a lost reply, each job answers as the first time (keyed by request id and token, as below),
# and the jobs it admitted then count against `slots` again: no reply has more than `slots` jobs admitted or
# answered 'cooldown'.
OFFER = (
    _PRELUDE
    + """
local worker, lease_ms, slots, n = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local group, route = ARGV[6], ARGV[7]
local K_JOBS = KEYS[17]
local W = 9  -- fields per job
for i = 0, n - 1 do
  local raw = redis.call('HGET', K_LEASE, ARGV[8 + W * i])
  if raw and cjson.decode(raw).token == ARGV[9 + W * i] then slots = slots - 1 end
end

-- One job: its reply, and whether the route took custody (the hand-over applies).
local function offer(rid, tok, tenant, prio, cost, member, record, fallbacks)
  local raw = redis.call('HGET', K_LEASE, rid)
  if raw then
    if cjson.decode(raw).token == tok then return {'admitted', tok}, true end  -- counted above
    return {'held'}, true
  end
  if redis.call('ZSCORE', K_FINISHED, rid) then return {'done'}, true end
  if L.tpm > 0 and cost > L.tpm then return {'too_large'}, false end
  local reason, at = refusal(cost, nil)
  if redis.call('HEXISTS', K_WAITING, rid) == 1 then
    return {'parked', reason or 'concurrency', tostring(at or 0)}, true
  end
  if reason == 'cooldown' and fallbacks == '1' then
    if slots > 0 then  -- the caller's slot goes to a fallback attempt
      slots = slots - 1
      return {'cooldown', tostring(at), '1'}, false
    end
    return {'cooldown', tostring(at), '0'}, false
  end
  -- Admitted at once only when nobody of its class or above waits (no queue to jump) and its tenant has room.
  local ahead = redis.call('ZCARD', K_WAIT.interactive)
  if prio == 'batch' then ahead = ahead + redis.call('ZCARD', K_WAIT.batch) end
  local _, cap = tenant_conf(tenant)
  if not reason and cap > 0 and tonumber(redis.call('HGET', K_DRR, 'f:' .. tenant) or '0') >= cap then
    reason, at = 'tenant', now + 250
  end
  if not reason and ahead == 0 and slots > 0 then
    lease(rid, tok, worker, tenant, prio, member, record, cost, lease_ms)
    slots = slots - 1
    return {'admitted', tok}, true
  end
  if reason then count_refusal(reason) elseif ahead == 0 then reason, at = 'worker', now + 250
  else reason, at = 'concurrency', now + 50 end
  redis.call('ZADD', K_WAIT[prio], 0, member)
  redis.call('HSET', K_WAITING, rid, record)
  if redis.call('HINCRBY', K_DRR, 'n:' .. prio .. ':' .. tenant, 1) == 1 then
    redis.call('RPUSH', K_RING[prio], tenant)
  end
  redis.call('HINCRBY', K_STATE, 'parked', 1)
  return {'parked', reason, tostring(at)}, true
end

local out = {}
for i = 0, n - 1 do
  local b = 8 + W * i
  local reply, custody = offer(ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], tonumber(ARGV[b + 4]), ARGV[b + 5],
    ARGV[b + 6], ARGV[b + 7])
  if custody and K_JOBS then
    redis.call('XACK', K_JOBS, group, ARGV[b + 8])
    if reply[1] == 'parked' then
      redis.call('HSET', KEYS[18 + i], 'waiting_on', reply[2], 'waiting_route', route, 'waiting_since', tostring(now))
      redis.call('HSETNX', KEYS[18 + i], 'state', 'queued')
    end
  end
  out[i + 1] = reply
end
return out
"""
)

# ARGV: now_override, call id, worker, n, lease_ms
# Returns {retry_at, waiting_on, {request id, token, wait record}...}
ADMIT = (
    _PRELUDE
    + """
return admit(ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]))
"""
)

# ARGV: now_override, request id, attempt token, lease token, worker, est_tokens, lease_ms, home (0/1)
# Returns {'ok'} | {'wait', retry_at, reason} | {'fenced'}
ACQUIRE = (
    _PRELUDE
    + """
local rid, tok, ltok, cost, lease_ms = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[6]), tonumber(ARGV[7])
if ARGV[8] == '1' then
  local raw = redis.call('HGET', K_LEASE, rid)
  if not raw or cjson.decode(raw).token ~= ltok then
    redis.call('ZREM', K_RESERVED, tok)
    return {'fenced'}
  end
end
if redis.call('ZSCORE', K_PERMITS, tok) then return {'ok'} end
local reason, at = refusal(cost, tok)
if reason then
  count_refusal(reason)
  -- Refused on concurrency: a reservation keeps the place, so a handoff ADMIT cannot take it from this retry.
  if reason == 'concurrency' then redis.call('ZADD', K_RESERVED, now + lease_ms, tok) end
  return {'wait', tostring(at), reason}
end
take_permit(tok, cost, lease_ms)
return {'ok'}
"""
)

# ARGV: now_override, worker, lease_ms, pairs, then `pairs` (request id, lease token) pairs, then permit tokens
# Returns the request ids whose lease is not (any more) this caller's.
RENEW = (
    _PRELUDE
    + """
local lease_ms, pairs = tonumber(ARGV[3]), tonumber(ARGV[4])
local lost = {}
for i = 0, pairs - 1 do
  local rid, ltok = ARGV[5 + 2 * i], ARGV[6 + 2 * i]
  local raw = redis.call('HGET', K_LEASE, rid)
  if raw and cjson.decode(raw).token == ltok then
    redis.call('ZADD', K_HELD, 'XX', now + lease_ms, rid)
  else
    table.insert(lost, rid)
  end
end
for i = 5 + 2 * pairs, #ARGV do
  redis.call('ZADD', K_PERMITS, 'XX', now + lease_ms, ARGV[i])
  redis.call('ZADD', K_RESERVED, 'XX', now + lease_ms, ARGV[i])
end
return lost
"""
)

# ARGV: now_override, request id, attempt token, lease token, final (0/1), outcome (ok | rate_limit |
#       overloaded | other), retry_after_ms ('' = none), actual_tokens ('' = none), then the handoff ADMIT's
#       call id, worker, n, lease_ms, then finished_ms (final=1: how long a late OFFER of the request answers
#       'done')
# Returns {'ok' | 'fenced', {ADMIT's reply}}
RELEASE = (
    _PRELUDE
    + """
local rid, tok, ltok, final, outcome = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local raw = redis.call('HGET', K_LEASE, rid)
local l = raw and cjson.decode(raw)
local status = 'ok'
if l and l.token ~= ltok then status = 'fenced' end
redis.call('ZREM', K_PERMITS, tok)
redis.call('ZREM', K_RESERVED, tok)
if ARGV[8] ~= '' and redis.call('ZSCORE', K_TPM, tok) then
  local old = tonumber(redis.call('HGET', K_COST, tok) or '0')
  local new = tonumber(ARGV[8])
  redis.call('HSET', K_COST, tok, new)
  redis.call('HINCRBY', K_STATE, 'tpm_sum', new - old)
end
if outcome == 'rate_limit' or outcome == 'overloaded' then
  if redis.call('HGET', K_STATE, 'cooldown_by') ~= tok then
    local streak = redis.call('HINCRBY', K_STATE, 'cooldown_streak', 1)
    redis.call('HSET', K_STATE, 'cooldown_by', tok, 'cooldown_reason', outcome)
    redis.call('HINCRBY', K_STATE, 'provider_429', 1)
    local wait
    if ARGV[7] ~= '' then
      wait = math.min(math.max(tonumber(ARGV[7]), L.cmin), L.cmax)
    else
      wait = math.min(L.cbase * 2 ^ (streak - 1), L.cmax)
    end
    local cu = tonumber(redis.call('HGET', K_STATE, 'cooldown_until') or '0')
    redis.call('HSET', K_STATE, 'cooldown_until', math.max(cu, now + math.floor(wait)))
  end
elseif outcome == 'ok' then
  redis.call('HSET', K_STATE, 'cooldown_streak', 0)
end
if final == '1' and l and status == 'ok' then
  redis.call('HDEL', K_LEASE, rid)
  redis.call('ZREM', K_HELD, rid)
  redis.call('HINCRBY', K_DRR, 'f:' .. l.tenant, -1)
  redis.call('ZADD', K_FINISHED, now + tonumber(ARGV[13]), rid)
end
local handoff = {'0', ''}
if tonumber(ARGV[11]) > 0 then handoff = admit(ARGV[9], ARGV[10], tonumber(ARGV[11]), tonumber(ARGV[12])) end
return {status, handoff}
"""
)


# -- budgets -------------------------------------------------------------------------------------------------------
# A tenant's budget store (``BudgetKeys.script_keys``: one hash tag, one Cluster slot; docs/capacity.md#budgets).
# Money is whole micro-units of the budget's currency (the worker rounds a worst case and a cost up), so every
# sum is an exact integer (HINCRBY). Every script first charges the reservations past their expiry whole (a dead
# or frozen worker's attempt may have been sent and billed: never given back unspent) and forgets settlement
# memos past theirs, then removes up to CLEAN_BATCH lines past their time (a window ended, and the window after
# it too) that hold nothing: a line still holding a reservation is looked at again a minute later. Idempotent for
# the caller: RESERVE is keyed by the reservation id (an attempt token): one already held answers ``held``, one
# already settled ``done`` (counted nothing again); EXTEND only moves expiries of reservations still held and
# names the others; SETTLE keyed by the same id charges once and answers a settlement sent again with the first
# one's memo. Removing lines depends only on the store and the clock, never on the call: a call sent again
# removes what any next call would (a line that is due and holds nothing), and never a line of the current or
# the previous window.
# KEYS (fixed order): state, held, res, reserved, spent, settled, charged, lines.
CLEAN_BATCH = 20
_BUDGET_PRELUDE = f"local CLEAN_BATCH = {CLEAN_BATCH}\n" + (
    """
local K_STATE, K_HELD, K_RES, K_RESERVED, K_SPENT, K_SETTLED, K_CHARGED, K_LINES =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]

local now
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function int(x) return string.format('%d', x) end

-- Ends reservation `id`: its amount leaves `reserved` of every line it counts in, `charge` enters `spent`.
-- A line removed meanwhile (only a reservation of amount 0 lets one go while held) is not made again.
local function settle(id, r, charge, how)
  local amount = tonumber(r.amount)
  for _, line in ipairs(r.lines) do
    if redis.call('HEXISTS', K_STATE, 'line:' .. line) == 1 then
      redis.call('HINCRBY', K_RESERVED, line, int(-amount))
      if charge > 0 then redis.call('HINCRBY', K_SPENT, line, int(charge)) end
    end
  end
  redis.call('HDEL', K_RES, id)
  redis.call('ZREM', K_HELD, id)
  local memo = how .. ':' .. int(charge)
  redis.call('ZADD', K_SETTLED, now + tonumber(r.done_ms), id)
  redis.call('HSET', K_CHARGED, id, memo)
  redis.call('HINCRBY', K_STATE, how, 1)
  return memo
end

local gone = redis.call('ZRANGEBYSCORE', K_HELD, '-inf', now, 'LIMIT', 0, 100)
for _, id in ipairs(gone) do
  local raw = redis.call('HGET', K_RES, id)
  if raw then
    local r = cjson.decode(raw)
    settle(id, r, tonumber(r.amount), 'expired')
  else
    redis.call('ZREM', K_HELD, id)
  end
end
local old = redis.call('ZRANGEBYSCORE', K_SETTLED, '-inf', now, 'LIMIT', 0, 100)
for _, id in ipairs(old) do
  redis.call('HDEL', K_CHARGED, id)
  redis.call('ZREM', K_SETTLED, id)
end
-- After the expiries above: a line an expired reservation held is free now.
local due = redis.call('ZRANGEBYSCORE', K_LINES, '-inf', now, 'LIMIT', 0, CLEAN_BATCH)
for _, line in ipairs(due) do
  if tonumber(redis.call('HGET', K_RESERVED, line) or '0') > 0 then
    redis.call('ZADD', K_LINES, now + 60000, line)  -- held: looked at again a minute later
  else
    redis.call('HDEL', K_RESERVED, line)
    redis.call('HDEL', K_SPENT, line)
    redis.call('HDEL', K_STATE, 'line:' .. line)
    redis.call('ZREM', K_LINES, line)
    redis.call('HINCRBY', K_STATE, 'removed', 1)
  end
end
"""
)

# ARGV: now_override, then reservations, each: id, amount (micro-units), lease_ms, done_ms (how long a
#       settlement's memo is kept), n, then n budgets of (line '<budget>|<window start ms>', limit (micro-units),
#       name, window end ms ('' for none), currency, removable from ms (the next window's end; '' for none)),
#       outermost first. Several in one call (the reservations a worker asked for in one event-loop pass) are
#       taken in order, each as if alone.
# Returns one reply per reservation: {'ok'} | {'held'} | {'done', memo} | {'full', budget name, left
#       (micro-units), settled ('1': the settled spend alone leaves no room, '0': reservations in flight hold it
#       and may give it back)}
RESERVE = (
    _BUDGET_PRELUDE
    + """
local function reserve(id, amount, lease_ms, done_ms, n, b)
  if redis.call('HEXISTS', K_RES, id) == 1 then return {'held'} end
  local memo = redis.call('HGET', K_CHARGED, id)
  if memo then return {'done', memo} end
  local lines = {}
  for i = 0, n - 1 do
    local line, limit, name = ARGV[b + 6 * i], tonumber(ARGV[b + 1 + 6 * i]), ARGV[b + 2 + 6 * i]
    local used = tonumber(redis.call('HGET', K_SPENT, line) or '0')
      + tonumber(redis.call('HGET', K_RESERVED, line) or '0')
    if used + amount > limit then
      redis.call('HINCRBY', K_STATE, 'refused', 1)
      local settled = tonumber(redis.call('HGET', K_SPENT, line) or '0') + amount > limit
      return {'full', name, int(math.max(0, limit - used)), settled and '1' or '0'}
    end
    table.insert(lines, line)
  end
  for i = 0, n - 1 do
    local line = ARGV[b + 6 * i]
    redis.call('HINCRBY', K_RESERVED, line, int(amount))
    redis.call('HSET', K_STATE, 'line:' .. line, cjson.encode({name = ARGV[b + 2 + 6 * i],
      limit = ARGV[b + 1 + 6 * i], window_end = ARGV[b + 3 + 6 * i], currency = ARGV[b + 4 + 6 * i]}))
    if ARGV[b + 5 + 6 * i] ~= '' then redis.call('ZADD', K_LINES, ARGV[b + 5 + 6 * i], line) end
  end
  redis.call('HSET', K_RES, id, cjson.encode({amount = int(amount), lines = lines, done_ms = done_ms}))
  redis.call('ZADD', K_HELD, now + lease_ms, id)
  redis.call('HINCRBY', K_STATE, 'reservations', 1)
  return {'ok'}
end

local out, i = {}, 2
while i <= #ARGV do
  local n = tonumber(ARGV[i + 4])
  table.insert(out, reserve(ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3], n, i + 5))
  i = i + 5 + 6 * n
end
return out
"""
)

# ARGV: now_override, lease_ms, then reservation ids
# Returns the ids no longer held (settled, or charged whole at expiry).
EXTEND = (
    _BUDGET_PRELUDE
    + """
local lost = {}
for i = 3, #ARGV do
  if redis.call('HEXISTS', K_RES, ARGV[i]) == 1 then
    redis.call('ZADD', K_HELD, 'XX', now + tonumber(ARGV[2]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""
)

# ARGV: now_override, then settlements, each: reservation id, mode (cost: charge the cost; whole: no usage
#       reported, charge the amount; release: nothing was sent, charge 0), cost (micro-units, mode cost; '' else).
#       Several in one call are taken in order, each as if alone.
# Returns one reply per settlement: {'settled', memo} | {'again', memo} | {'unknown'}; memo = '<how>:<charged
#       micro-units>'
SETTLE = (
    _BUDGET_PRELUDE
    + """
local function settle_one(id, mode, cost)
  local raw = redis.call('HGET', K_RES, id)
  if not raw then
    local memo = redis.call('HGET', K_CHARGED, id)
    if memo then return {'again', memo} end
    return {'unknown'}
  end
  local r = cjson.decode(raw)
  local charge = tonumber(r.amount)
  if mode == 'release' then charge = 0 elseif mode == 'cost' then charge = tonumber(cost) end
  -- A cost above the worst case (an estimate beaten): charged all the same, it was spent; counted apart.
  if charge > tonumber(r.amount) then redis.call('HINCRBY', K_STATE, 'overrun', 1) end
  return {'settled', settle(id, r, charge, mode)}
end

local out = {}
for i = 2, #ARGV, 3 do table.insert(out, settle_one(ARGV[i], ARGV[i + 1], ARGV[i + 2])) end
return out
"""
)
