-- forget.lua: delete what a pool keeps for a tenant or a quota level (a team) that the
-- configuration no longer names, if nothing of it is alive and it has been idle long enough;
-- or only say whether it would (kvgate-prune's dry run). Run by admission/prune.py.
--
-- KEYS[1]  clock            HASH  frozen_us (tests only)
-- KEYS[2]  tenant_queued    HASH  tenant -> queued count
-- KEYS[3]  tenant_inflight  ZSET  tenant -> tokens in flight
-- KEYS[4..6] light vip, normal, batch   ZSET tenant -> µs
--
-- ARGV[1]  key prefix of the pool (the tenant's hash, bucket and flows, and a level's hash, are
--          built from it, as in admit.lua)
-- ARGV[2]  'tenant' or 'level'
-- ARGV[3]  the tenant's or the level's name
-- ARGV[4]  the least idle time (µs): keys written more recently are kept
-- ARGV[5]  '1': delete; '0': only judge
--
-- Returns {verdict, reason, idle_us, keys}: verdict 'forgotten' (deleted), 'forgettable'
-- (would be, with ARGV[5] '0'), 'kept' (reason: 'queued', 'in_flight', 'held' (tokens of live
-- tasks reserved there), 'recent' (written less than ARGV[4] ago) or 'absent'); idle_us = now
-- minus the last write the keys record (-1 when they record none); keys = how many keys it
-- deleted (or would).
--
-- Why these checks make deletion safe: a tenant's live tasks (queued or released) are counted
-- in its queued count, its in-flight tokens and its bucket's `held`, and a level's in its own
-- `held`; with none, no task will credit the keys again. A task admitted before `held` was
-- counted (an upgrade) and still alive ends against absent keys: bucket_credit() in _lib.lua
-- writes nothing without the bucket's rate, and the unhold leaves no field. The idle time
-- guards against a gateway that still has the name configured (a rolling update, another
-- deployment on the same pool): it writes the bucket at every admit.

local prefix, kind, name = ARGV[1], ARGV[2], ARGV[3]
local min_idle, apply = tonumber(ARGV[4]), ARGV[5] == '1'
local now = now_us(KEYS[1])

-- The last write a hash records (µs), or nil.
local function written_at(key, field)
  return tonumber(redis.call('HGET', key, field) or '')
end

local function held(key)
  return (tonumber(redis.call('HGET', key, 'held') or '0') or 0) > 0
end

local keys, last = {}, nil
local function note(key, at)
  if redis.call('EXISTS', key) == 1 then table.insert(keys, key) end
  if at ~= nil and (last == nil or at > last) then last = at end
end

if kind == 'tenant' then
  local tkey, bkey = tenant_key(prefix, name), bucket_key(prefix, name)
  if redis.call('HEXISTS', KEYS[2], name) == 1 then return {'kept', 'queued', -1, 0} end
  for tier = 0, TIER_QUEUE_COUNT - 1 do
    if redis.call('EXISTS', flow_key(prefix, tier, name)) == 1 then
      return {'kept', 'queued', -1, 0}
    end
  end
  if redis.call('ZSCORE', KEYS[3], name)
      or (tonumber(redis.call('HGET', tkey, 'inflight_tokens') or '0') or 0) > 0 then
    return {'kept', 'in_flight', -1, 0}
  end
  if held(bkey) then return {'kept', 'held', -1, 0} end
  note(bkey, written_at(bkey, 'updated_us'))
  note(tkey, written_at(tkey, 'drain_us'))
elseif kind == 'level' then
  local qkey = quota_key(prefix, name)
  if held(qkey) then return {'kept', 'held', -1, 0} end
  note(qkey, written_at(qkey, 'updated_us'))
else
  return redis.error_reply('forget.lua: ARGV[2] must be tenant or level, got ' .. tostring(kind))
end

local idle = last and math.max(0, now - last) or -1
if #keys == 0 then return {'kept', 'absent', idle, 0} end
if last ~= nil and now - last < min_idle then return {'kept', 'recent', idle, 0} end
if not apply then return {'forgettable', '', idle, #keys} end
redis.call('DEL', unpack(keys))
if kind == 'tenant' then
  for i = 4, 6 do redis.call('ZREM', KEYS[i], name) end
end
return {'forgotten', '', idle, #keys}
