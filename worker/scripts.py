"""Server-side Lua scripts: the only way the worker changes a request's keys.

Rule: every write to a request's logs is one script call that first checks the fencing ``epoch`` in the
status hash, so a worker whose job was taken over can never append again. Appends are idempotent: entry
ids are fixed by (attempt, index) and (attempt, seq), and XADD refuses an id at or below a stream's last,
so a batch re-sent after a connection error is never duplicated.
All keys of one call share the request's hash tag (one Cluster slot).
"""

from __future__ import annotations

__all__ = ["APPEND", "CLAIM", "FINALIZE"]

# KEYS: status
# ARGV: job_entry, worker, now_ms, route, model, metadata_json, raw_key, events_key, maxlen,
#       normalizer_version, contract_version, request_id
# Returns {outcome, epoch, attempt, visible, cancel, published}
CLAIM = """
local st = KEYS[1]
local state = redis.call('HGET', st, 'state')
local entry = redis.call('HGET', st, 'job_entry')
local function info(outcome)
  local f = redis.call('HMGET', st, 'epoch', 'attempt', 'visible', 'cancel', 'published')
  return {outcome, f[1] or '0', f[2] or '0', f[3] or '0', f[4] or '0', f[5] or '1'}
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
# ARGV: epoch, attempt, maxlen, raw (msgpack: [[index, kind, event, data, id, offset, ts], ...]),
#       events (msgpack: [[seq, type, json, is_delta], ...])
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
local maxlen = ARGV[3]
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
  if maxlen ~= '0' then
    err = stored(redis.pcall('XADD', raw, 'MAXLEN', '~', maxlen, id, 'kind', r[2], 'event', r[3], 'data', r[4],
      'id', r[5], 'offset', r[6], 'ts', r[7]))
  else
    err = stored(redis.pcall('XADD', raw, id, 'kind', r[2], 'event', r[3], 'data', r[4], 'id', r[5],
      'offset', r[6], 'ts', r[7]))
  end
  if err then return err end
end
local visible = false
for _, e in ipairs(evs) do
  local id = attempt .. '-' .. e[1]
  if maxlen ~= '0' then
    err = stored(redis.pcall('XADD', events, 'MAXLEN', '~', maxlen, id, 'type', e[2], 'event', e[3]))
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

# KEYS: status, raw, events
# ARGV: epoch, ttl_seconds, then field/value pairs for the status hash
# Sets raw_count / event_count from the entry ids: each attempt's raw indexes run 0, 1, ... and its seqs
# 1, 2, ..., so its last entry tells how many it appended, even when MAXLEN trimmed the older ones.
# Returns 'ok' or 'fenced'.
FINALIZE = """
local st, raw, events = KEYS[1], KEYS[2], KEYS[3]
local f = redis.call('HMGET', st, 'epoch', 'attempt')
if f[1] ~= ARGV[1] then return 'fenced' end
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
if #fields > 0 then redis.call('HSET', st, unpack(fields)) end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ttl) end
end
return 'ok'
"""
