-- forget.lua: delete what a pool keeps for a tenant or a quota level (a team) that the
-- configuration no longer names, if nothing of it is alive, it holds nothing a fresh key would
-- not (a spent bucket or allowance), and it has been idle long enough; or only say whether it
-- would (kvgate-prune's dry run). Run by admission/store.py PoolStore.forget.
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
-- ARGV[6]  '1': delete a spent bucket or allowance too (below; optional, default '0')
--
-- Returns {verdict, reason, idle_us, keys}: verdict 'forgotten' (deleted), 'forgettable'
-- (would be, with ARGV[5] '0'), 'kept' (reason: 'queued', 'in_flight', 'held' (tokens of live
-- tasks reserved there), 'wrong_type' (a key of the name that is no hash: written by hand),
-- 'spent' (its bucket below its burst, or an allowance used in the current day or month),
-- 'recent' (written less than ARGV[4] ago) or 'absent' (no key)); idle_us = now minus the
-- last write the keys record (-1 when they record none, or for a reason found before they are
-- read); keys = how many keys it deleted (or would).
--
-- Why these checks make deletion safe: a tenant's live tasks (queued or released) are counted
-- in its queued count and flows, its in-flight tokens and its bucket's `held`, and a level's in
-- its own `held`; with none, no task will credit the keys again. A name configured again later
-- starts from fresh keys: a full bucket and unused allowances, which is why a spent one is kept
-- (deleting it would hand a cut-off tenant, once re-added, its month's allowance or its prepaid
-- balance again) unless ARGV[6] says otherwise; its fairness counters start at the tier's
-- floor, as any new tenant's. The idle time guards against a gateway that still admits for the
-- name (it writes the bucket at every admit it lets through).
local prefix, kind, name = ARGV[1], ARGV[2], ARGV[3]
local min_idle, apply, force = tonumber(ARGV[4]), ARGV[5] == '1', ARGV[6] == '1'
local now = now_us(KEYS[1])

local function held(key)
  return (tonumber(redis.call('HGET', key, 'held') or '0') or 0) > 0
end

-- Whether a bucket's hash holds what a fresh one would not: a level below its burst once
-- refilled to now, or an allowance used in the period it counts in now (period_of() in
-- _quota.lua: the later one while the clock is behind a step back).
local function spent(key)
  local f = hash_fields(key, {'rate', 'burst', 'day', 'day_used', 'month', 'month_used'})
  local rate, burst = tonumber(f.rate), tonumber(f.burst)
  if rate and burst and bucket_level(key, now, rate, burst) < burst * 1000000 then
    return true
  end
  local periods = {f.day, f.day_used, f.month, f.month_used}
  local today = math.floor(now / DAY_US)
  return period_used(periods, 'day', period_of(periods, 'day', today)) > 0
    or period_used(periods, 'month', period_of(periods, 'month', month_of_day(today))) > 0
end

local keys, last = {}, nil
-- Adds `key` (with the µs of its last write, field `field`) to what would be deleted; false
-- when it exists and is no hash.
local function note(key, field)
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then return true end
  if kind_of ~= 'hash' then return false end
  table.insert(keys, key)
  local at = tonumber(redis.call('HGET', key, field) or '')
  if at ~= nil and (last == nil or at > last) then last = at end
  return true
end

local bucket
if kind == 'tenant' then
  local tkey = tenant_key(prefix, name)
  bucket = bucket_key(prefix, name)
  if redis.call('HEXISTS', KEYS[2], name) == 1 then return {'kept', 'queued', -1, 0} end
  for tier = 0, TIER_QUEUE_COUNT - 1 do
    if redis.call('EXISTS', flow_key(prefix, tier, name)) == 1 then
      return {'kept', 'queued', -1, 0}
    end
  end
  if redis.call('ZSCORE', KEYS[3], name) then return {'kept', 'in_flight', -1, 0} end
  if not (note(bucket, 'updated_us') and note(tkey, 'drain_us')) then
    return {'kept', 'wrong_type', -1, 0}
  end
  if (tonumber(redis.call('HGET', tkey, 'inflight_tokens') or '0') or 0) > 0 then
    return {'kept', 'in_flight', -1, 0}
  end
elseif kind == 'level' then
  bucket = quota_key(prefix, name)
  if not note(bucket, 'updated_us') then return {'kept', 'wrong_type', -1, 0} end
else
  return redis.error_reply('forget.lua: ARGV[2] must be tenant or level, got ' .. tostring(kind))
end

local idle = last and math.max(0, now - last) or -1
if #keys == 0 then return {'kept', 'absent', idle, 0} end
if held(bucket) then return {'kept', 'held', idle, 0} end
if not force and spent(bucket) then return {'kept', 'spent', idle, 0} end
if last ~= nil and now - last < min_idle then return {'kept', 'recent', idle, 0} end
if not apply then return {'forgettable', '', idle, #keys} end
redis.call('DEL', unpack(keys))
if kind == 'tenant' then
  for i = 4, 6 do redis.call('ZREM', KEYS[i], name) end
end
return {'forgotten', '', idle, #keys}
