"""Server-side Lua scripts: the only way the worker changes a request's keys.

Rule: every write to a request's logs is one script call that first checks the fencing ``epoch`` in the
status hash, so a worker whose job was taken over can never append again; appends skip entries at or
below the last written (attempt, index) so a batch re-sent after a connection error is never duplicated.
All keys of one call share the request's hash tag (one Cluster slot).
"""

from __future__ import annotations

__all__ = ["APPEND", "CLAIM", "FINALIZE"]

# KEYS: status
# ARGV: job_entry, worker, now_ms, route, model, metadata_json, raw_key, events_key, maxlen,
#       normalizer_version, contract_version, request_id
# Returns {outcome, epoch, attempt, last_seq, visible, attempt_terminal, cancel, published}
CLAIM = """
local st = KEYS[1]
local state = redis.call('HGET', st, 'state')
local entry = redis.call('HGET', st, 'job_entry')
local function info(outcome)
  local f = redis.call('HMGET', st, 'epoch', 'attempt', 'last_seq', 'visible', 'attempt_terminal', 'cancel',
    'published')
  return {outcome, f[1] or '0', f[2] or '0', f[3] or '0', f[4] or '0', f[5] or '', f[6] or '0', f[7] or '1'}
end
if state == 'completed' or state == 'failed' or state == 'interrupted' then
  return info('done')
end
if state == 'running' and entry and entry ~= '' and entry ~= ARGV[1] then
  return info('duplicate')
end
local outcome = 'run'
if state == 'running' then outcome = 'takeover' end
redis.call('HINCRBY', st, 'epoch', 1)
redis.call('HSET', st, 'state', 'running', 'job_entry', ARGV[1], 'worker', ARGV[2], 'route', ARGV[4],
  'model', ARGV[5], 'metadata', ARGV[6], 'raw_stream', ARGV[7], 'events_stream', ARGV[8], 'maxlen', ARGV[9],
  'normalizer_version', ARGV[10], 'contract_version', ARGV[11], 'request_id', ARGV[12])
if outcome == 'run' then
  redis.call('HSET', st, 'started_at', ARGV[3])
  redis.call('HSETNX', st, 'queued_at', ARGV[3])
  redis.call('HSETNX', st, 'attempt', '0')
end
return info(outcome)
"""

# KEYS: status, raw, events
# ARGV: epoch, attempt, maxlen, now_ms, raw (msgpack: [[index, kind, event, data, id, offset, ts], ...]),
#       events (msgpack: [[seq, type, json, is_delta, terminal_status], ...])
# Two packed arguments instead of a dozen per event: packing arguments is most of a client's CPU.
# Returns 'ok' or 'fenced'.
APPEND = """
local st, raw, events = KEYS[1], KEYS[2], KEYS[3]
-- One read and one write of the status hash per call: each redis.call costs more than the XADD it wraps.
local f = redis.call('HMGET', st, 'epoch', 'attempt', 'raw_attempt', 'raw_last', 'ev_attempt', 'last_seq',
  'raw_count', 'event_count')
if f[1] ~= ARGV[1] then return 'fenced' end
local attempt = tonumber(ARGV[2])
local maxlen = tonumber(ARGV[3])
local cur = tonumber(f[2] or '0')
if attempt < cur then return 'fenced' end
local raws = cmsgpack.unpack(ARGV[5])
local evs = cmsgpack.unpack(ARGV[6])
local ra, rl = tonumber(f[3] or '0'), tonumber(f[4] or '-1')
local ea, es = tonumber(f[5] or '0'), tonumber(f[6] or '0')
if ra ~= attempt then rl = -1 end
if ea ~= attempt then es = 0 end
local added_raw, added_ev = 0, 0
for _, r in ipairs(raws) do
  local idx = r[1]
  if idx > rl then
    if maxlen > 0 then
      redis.call('XADD', raw, 'MAXLEN', '~', maxlen, attempt .. '-' .. idx, 'kind', r[2], 'event', r[3], 'data', r[4],
        'id', r[5], 'offset', r[6], 'ts', r[7])
    else
      redis.call('XADD', raw, attempt .. '-' .. idx, 'kind', r[2], 'event', r[3], 'data', r[4], 'id', r[5],
        'offset', r[6], 'ts', r[7])
    end
    rl, ra = idx, attempt
    added_raw = added_raw + 1
  end
end
local visible = false
local terminal = nil
for _, e in ipairs(evs) do
  local seq = e[1]
  if seq > es then
    if maxlen > 0 then
      redis.call('XADD', events, 'MAXLEN', '~', maxlen, attempt .. '-' .. seq, 'type', e[2], 'event', e[3])
    else
      redis.call('XADD', events, attempt .. '-' .. seq, 'type', e[2], 'event', e[3])
    end
    es, ea = seq, attempt
    added_ev = added_ev + 1
    if e[4] == 1 then visible = true end
    if e[5] ~= '' then terminal = e[5] end
  end
end
local out = {'raw_attempt', ra, 'raw_last', rl, 'ev_attempt', ea, 'last_seq', es, 'attempt', attempt,
  'updated_at', ARGV[4]}
if added_raw > 0 then
  table.insert(out, 'raw_count'); table.insert(out, tonumber(f[7] or '0') + added_raw)
end
if added_ev > 0 then
  table.insert(out, 'event_count'); table.insert(out, tonumber(f[8] or '0') + added_ev)
end
-- A new attempt starts invisible and without a terminal; this call's events may change both at once.
if visible then
  table.insert(out, 'visible'); table.insert(out, '1')
elseif attempt > cur then
  table.insert(out, 'visible'); table.insert(out, '0')
end
if terminal then
  table.insert(out, 'attempt_terminal'); table.insert(out, terminal)
elseif attempt > cur then
  table.insert(out, 'attempt_terminal'); table.insert(out, '')
end
redis.call('HSET', st, unpack(out))
return 'ok'
"""

# KEYS: status, raw, events
# ARGV: epoch, ttl_seconds, then field/value pairs for the status hash
# Returns 'ok' or 'fenced'.
FINALIZE = """
local st = KEYS[1]
if redis.call('HGET', st, 'epoch') ~= ARGV[1] then return 'fenced' end
local fields = {}
for i = 3, #ARGV do table.insert(fields, ARGV[i]) end
if #fields > 0 then redis.call('HSET', st, unpack(fields)) end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ttl) end
end
return 'ok'
"""
