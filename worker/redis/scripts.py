"""Server-side Lua scripts: the only way the worker changes a request's keys, publishes a terminal entry,
dead-letters a job or keeps its jobs alive.

Rule: every script is idempotent for its caller, so a call whose reply was lost (the connection broke
after Redis ran it) can be sent again and answers as the first one did:

- ``CLAIM`` carries a token per claim: a re-sent claim finds its own token and returns the stored answer
  instead of bumping the epoch again (which would look like a takeover of itself).
- ``APPEND``'s entry ids are fixed by (attempt, index) and (attempt, seq); XADD refuses an id at or below a
  stream's last, so a re-sent batch adds nothing. Appends are fenced: a stale epoch is refused.
- ``FINALIZE`` is fenced by the epoch too; once the state is terminal a re-sent call changes nothing but
  the ``durability`` field it carries (so it still writes: a ``WAIT`` after it on a new connection counts
  replicas of a write of that connection, not of nothing).
- ``PUBLISH`` and ``DEAD_LETTER`` add to a shared stream with an auto id, so each first checks a marker
  key (``SET`` with the retention TTL, holding the entry id it wrote): one entry per request / per job,
  whatever reply is lost (a re-sent call rewrites the marker as it is, for the same reason as above). The
  marker lives beside its stream (``schemas.keys``), so the pair shares a Redis Cluster slot.
- ``HEARTBEAT`` refreshes only the entries this consumer still owns (XPENDING names the owner) and
  returns the ones it lost, so a worker woken from a freeze neither steals back a job taken over
  meanwhile nor keeps it looking busy.
- ``TRIM_JOBS`` removes the jobs stream's entries every group has settled, judged from the groups' state
  in the same atomic call: sent again, it removes what is settled by then, never more.

All keys of one call share a hash tag (one Cluster slot).
"""

from __future__ import annotations

import functools
import hashlib

__all__ = ["APPEND", "APPEND_AFTER", "CLAIM", "DEAD_LETTER", "FINALIZE", "HEARTBEAT", "PUBLISH", "TRIM_JOBS", "sha"]


@functools.cache
def sha(source: str) -> str:
    """A script's name for ``EVALSHA`` (the SHA1 of its source), computed once per process."""
    return hashlib.sha1(source.encode()).hexdigest()


# KEYS: status
# ARGV: token, job_entry, worker, now_ms, route, model, metadata_json, raw_key, events_key, maxlen,
#       normalizer_version, contract_version, request_id, job_stream ('' on the single-instance layout)
# Returns {outcome, epoch, attempt, visible, cancel, published}; outcome: run | takeover | duplicate | done
CLAIM = """
local st = KEYS[1]
local function info(outcome)
  local f = redis.call('HMGET', st, 'epoch', 'attempt', 'visible', 'cancel', 'published')
  return {outcome, f[1] or '0', f[2] or '0', f[3] or '0', f[4] or '0', f[5] or '1'}
end
local cur = redis.call('HMGET', st, 'state', 'job_entry', 'claim_token', 'claim_outcome')
local state, entry = cur[1], cur[2]
if cur[3] == ARGV[1] then
  -- our own claim, sent again after its reply was lost: the same answer (nothing was done since)
  return info(cur[4])
end
if state == 'completed' or state == 'failed' or state == 'interrupted' then
  return info('done')
end
if state == 'running' and entry and entry ~= '' and entry ~= ARGV[2] then
  return info('duplicate')
end
local outcome = 'run'
if state == 'running' then outcome = 'takeover' end
redis.call('HDEL', st, 'waiting_on', 'waiting_route', 'waiting_since')
redis.call('HINCRBY', st, 'epoch', 1)
redis.call('HSET', st, 'state', 'running', 'job_entry', ARGV[2], 'worker', ARGV[3], 'route', ARGV[5],
  'model', ARGV[6], 'metadata', ARGV[7], 'raw_stream', ARGV[8], 'events_stream', ARGV[9], 'maxlen', ARGV[10],
  'normalizer_version', ARGV[11], 'contract_version', ARGV[12], 'request_id', ARGV[13],
  'claim_token', ARGV[1], 'claim_outcome', outcome)
if ARGV[14] and ARGV[14] ~= '' then redis.call('HSET', st, 'job_stream', ARGV[14]) end
if outcome == 'run' then
  redis.call('HSET', st, 'started_at', ARGV[4])
  redis.call('HSETNX', st, 'queued_at', ARGV[4])
  redis.call('HSETNX', st, 'attempt', '0')
end
return info(outcome)
"""

# KEYS: status, raw, events
# ARGV: epoch, attempt, maxlen, raw (msgpack: rows, see ``sluice.worker.append.log``),
#       events (msgpack: [[seq, type, json, is_delta], ...]), then the batch's blobs (exact bytes)
# Two packed arguments instead of a dozen per event: packing arguments is most of a client's CPU.
# Returns 'ok' or 'fenced'.
APPEND = """
local st, raw, events = KEYS[1], KEYS[2], KEYS[3]
-- Every redis.call costs more than the XADD it wraps, so the status hash is read once and written only when
-- an attempt starts or first shows a delta. Entry ids are '<attempt>-<index>' / '<attempt>-<seq>', so XADD
-- itself refuses what is already stored (a batch sent again after a lost reply); counts and the last seq
-- are read off those ids when the request finishes.
local f = redis.call('HMGET', st, 'epoch', 'attempt', 'visible')
if f[1] ~= ARGV[1] then return 'fenced' end
local attempt = tonumber(ARGV[2])
local cur = tonumber(f[2] or '0')
if attempt < cur then return 'fenced' end
local cap = {}
if ARGV[3] ~= '0' then cap = {'MAXLEN', '~', ARGV[3]} end
local raws = cmsgpack.unpack(ARGV[4])
local evs = cmsgpack.unpack(ARGV[5])
local function stored(res)
  if type(res) == 'table' and res.err and not string.find(res.err, 'equal or smaller', 1, true) then
    return res
  end
end
local err
for _, r in ipairs(raws) do
  local id = attempt .. '-' .. r[1]
  if #r == 7 then  -- nearly every row: no optional field, the direct call
    if ARGV[3] ~= '0' then
      err = stored(redis.pcall('XADD', raw, 'MAXLEN', '~', ARGV[3], id, 'kind', r[2], 'event', r[3], 'data', r[4],
        'id', r[5], 'offset', r[6], 'ts', r[7]))
    else
      err = stored(redis.pcall('XADD', raw, id, 'kind', r[2], 'event', r[3], 'data', r[4], 'id', r[5],
        'offset', r[6], 'ts', r[7]))
    end
  else
    -- optional name/value pairs follow (redacted, unframed, data_bytes, body); a number names a blob
    local args = {raw}
    for _, c in ipairs(cap) do table.insert(args, c) end
    for _, v in ipairs({id, 'kind', r[2], 'event', r[3], 'data', r[4], 'id', r[5], 'offset', r[6], 'ts', r[7]}) do
      table.insert(args, v)
    end
    for i = 8, #r, 2 do
      local v = r[i + 1]
      if type(v) == 'number' then v = ARGV[5 + v] end  -- exact bytes, passed as their own argument
      table.insert(args, r[i]); table.insert(args, v)
    end
    err = stored(redis.pcall('XADD', unpack(args)))
  end
  if err then return err end
end
local visible = false
for _, e in ipairs(evs) do
  local id = attempt .. '-' .. e[1]
  if #cap > 0 then
    err = stored(redis.pcall('XADD', events, 'MAXLEN', '~', ARGV[3], id, 'type', e[2], 'event', e[3]))
  else
    err = stored(redis.pcall('XADD', events, id, 'type', e[2], 'event', e[3]))
  end
  if err then return err end
  if e[4] == 1 then visible = true end
end
if attempt > cur then
  redis.call('HSET', st, 'attempt', attempt, 'visible', visible and '1' or '0')
elseif visible and f[3] ~= '1' then
  redis.call('HSET', st, 'visible', '1')
end
return 'ok'
"""

# APPEND, after a check: this attempt's streams must still reach what this worker had stored in them. Sent
# after a connection to Redis broke or a reply was lost, the only moments a failover can have dropped
# acknowledged appends (replication is asynchronous): appending after such a hole would leave a seq gap.
# KEYS, ARGV: as APPEND, plus a last argument "<raw index> <seq>" (-1: nothing stored yet).
# Returns 'gap' (nothing written) or APPEND's reply.
APPEND_AFTER = (
    """
local want = ARGV[#ARGV]
local sp = string.find(want, ' ', 1, true)
local function reaches(key, n)
  if n < 0 then return true end
  local a = ARGV[2]
  local top = redis.call('XREVRANGE', key, a .. '-18446744073709551615', a .. '-0', 'COUNT', 1)
  return #top > 0 and tonumber(string.match(top[1][1], '-(%d+)$')) >= n
end
local want_raw, want_seq = tonumber(string.sub(want, 1, sp - 1)), tonumber(string.sub(want, sp + 1))
if not reaches(KEYS[2], want_raw) or not reaches(KEYS[3], want_seq) then return 'gap' end
"""
    + APPEND
)

# KEYS: status, raw, events
# ARGV: epoch, ttl_seconds, then field/value pairs for the status hash (``state`` among them)
# Sets raw_count / event_count from the entry ids: each attempt's raw indexes run 0, 1, ... and its seqs
# 1, 2, ..., so its last entry tells how many it appended, even when MAXLEN trimmed the older ones.
# Returns 'ok' or 'fenced'.
FINALIZE = """
local st, raw, events = KEYS[1], KEYS[2], KEYS[3]
local f = redis.call('HMGET', st, 'epoch', 'attempt', 'state')
if f[1] ~= ARGV[1] then return 'fenced' end
if f[3] == 'completed' or f[3] == 'failed' or f[3] == 'interrupted' then
  for i = 3, #ARGV, 2 do
    if ARGV[i] == 'durability' then redis.call('HSET', st, 'durability', ARGV[i + 1]) end
  end
  return 'ok'
end
local function appended(key, first)
  local n = 0
  for a = 1, tonumber(f[2] or '0') do
    local top = redis.call('XREVRANGE', key, a .. '-18446744073709551615', a .. '-0', 'COUNT', 1)
    if #top > 0 then n = n + tonumber(string.match(top[1][1], '-(%d+)$')) + 1 - first end
  end
  return n
end
local fields = {'raw_count', appended(raw, 0), 'event_count', appended(events, 1)}
for i = 3, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', st, unpack(fields))
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ttl) end
end
return 'ok'
"""

# KEYS: stream, marker
# ARGV: ttl_seconds, maxlen, then field/value pairs of the entry
# Adds the entry unless the marker says it was added already; returns the entry id either way.
_ONCE = """
local done = redis.call('GET', KEYS[2])
if done then
  redis.call('SET', KEYS[2], done, 'KEEPTTL')
  return done
end
local args = {KEYS[1], 'MAXLEN', '~', ARGV[2], '*'}
for i = 3, #ARGV do table.insert(args, ARGV[i]) end
local id = redis.call('XADD', unpack(args))
local ttl = tonumber(ARGV[1])
if ttl > 0 then
  redis.call('SET', KEYS[2], id, 'EX', ttl)
else
  redis.call('SET', KEYS[2], id)
end
return id
"""
PUBLISH = _ONCE  # a request's terminal-stream entry
DEAD_LETTER = _ONCE  # a job's dead-letter entry

# KEYS: jobs
# ARGV: group, consumer, entry ids...
# XCLAIM (min-idle 0, JUSTID) resets an entry's idle time; only for entries this consumer still owns.
# Returns the ids it no longer owns (taken over, or acked and gone).
HEARTBEAT = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# KEYS: jobs
# ARGV: limit: the most entries one call removes (a long untrimmed stream is caught up in bounded steps, not in
#       one long block of Redis)
# Keeps every entry from the oldest one some group has not settled: per group, the first of its oldest pending
# entry (XPENDING) and its first entry after last-delivered-id (XRANGE exclusive, Redis 6.2+); nothing at all
# when the stream has no group. Every entry before it was delivered to every group and acknowledged; when no
# group has anything unsettled, every entry is. XTRIM (MINID: Redis 6.2+, Valkey) removes them from the head:
# first whole radix nodes (``~``, at most ``limit`` entries), then, when that stopped well short of the limit
# (so at the boundary's own node, a few dozen entries), the rest exactly; a call that removed more than half
# the limit leaves that to the next. From the head only, so every group's lag (XINFO GROUPS) stays exact.
# Returns the number of entries removed.
TRIM_JOBS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
local keep = nil
for _, g in ipairs(groups) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  local first = nil
  if tonumber(f['pending']) > 0 then
    first = redis.call('XPENDING', KEYS[1], f['name'])[2]
  end
  local nxt = redis.call('XRANGE', KEYS[1], '(' .. f['last-delivered-id'], '+', 'COUNT', 1)
  if #nxt > 0 and (first == nil or older(nxt[1][1], first)) then first = nxt[1][1] end
  if first ~= nil and (keep == nil or older(first, keep)) then keep = first end
end
local limit = tonumber(ARGV[1])
local how = keep and {'MINID', keep} or {'MAXLEN', '0'}
local n = redis.call('XTRIM', KEYS[1], how[1], '~', how[2], 'LIMIT', limit)
if n <= limit / 2 then
  n = n + redis.call('XTRIM', KEYS[1], how[1], how[2])
end
return n
"""
