-- _lib.lua: helpers prepended to every script at load time, the first of the library files
-- (admission/scripts.py LIBRARY: units, key names, clocks, token buckets); not a script of its
-- own.
--
-- Units used everywhere: times in microseconds of Redis TIME (in a test process only, the
-- pool clock's frozen_us when set, so that tests can stop and move time without sleeping:
-- TEST_CLOCK, defined on the line before this file by admission/scripts.py, is false in
-- every service, and then frozen_us is never read);
-- token amounts in whole tokens, except a bucket's level, kept in micro-tokens so that
-- refill (rate tokens/s x elapsed µs) stays an exact integer.
-- Dynamic key suffixes below mirror admission/keys.py (task:, bucket:, gateway:, running,
-- node_guests, node_guest_pace, tenant:, flows:, flow:, vtime, quota:, light:, tenant_inflight).

local TIER_QUEUE_COUNT = 3
local TIER_LABELS = {'vip', 'normal', 'batch'}

local function fmt(n)
  return string.format('%.0f', n)
end

-- Redis TIME in µs: the server's own clock, which no test freezes.
local function time_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function now_us(clock_key)
  if TEST_CLOCK then
    local frozen = redis.call('HGET', clock_key, 'frozen_us')
    if frozen then return tonumber(frozen) end
  end
  return time_us()
end

-- Queue scores must be strictly increasing even if the server clock steps back or two
-- admits share a microsecond, or FIFO within a tier would fall back to member order.
local function queue_clock(clock_key, now)
  local last = tonumber(redis.call('HGET', clock_key, 'last_us') or '0') or 0
  local score = now
  if score <= last then score = last + 1 end
  redis.call('HSET', clock_key, 'last_us', fmt(score))
  return score
end

-- A hash's fields read by name: HMGET of `names`, returned as a table keyed by those names (a
-- missing field stays nil), so that every script reads st.zone or task.cost, never st[1] or
-- f[4], and the lists of fields are written once, below.
local function hash_fields(key, names)
  local values = redis.call('HMGET', key, unpack(names))
  local out = {}
  for i, name in ipairs(names) do
    if values[i] then out[name] = values[i] end
  end
  return out
end

-- Every field of a hash as a table, in one HGETALL: for a hash read whole, such as a field
-- per node that a placement weighs (a call per node cost 2 µs each, a pool of 256 nodes 1.5
-- ms of every admit).
local function all_fields(key)
  local flat = redis.call('HGETALL', key)
  local fields = {}
  for i = 1, #flat, 2 do fields[flat[i]] = flat[i + 1] end
  return fields
end

-- The state hash's fields that say where a task may run (placement_of()).
local PLACEMENT_FIELDS = {'dedicated_nodes', 'dedicated_tiers', 'dedicated_guest_prompt',
  'dedicated_guest_cap', 'dedicated_guest_rate', 'dedicated_guest_output',
  'dedicated_guests_closed', 'prefill_quiet', 'vip_ttft_objective_ms', 'lane_output'}
-- The state hash's fields a capacity 429's hint is computed from (hint_facts()).
local HINT_FIELDS = {'zone', 'updated_us', 'drain_0', 'drain_1', 'drain_2', 'red_clear_s'}
-- What admit.lua reads of the state hash: both of the above, and pool_usage ('' while the
-- pool has no usable node: its RED is an outage, not a full cache).
local ADMIT_STATE_FIELDS = {unpack(HINT_FIELDS)}
for _, name in ipairs(PLACEMENT_FIELDS) do table.insert(ADMIT_STATE_FIELDS, name) end
table.insert(ADMIT_STATE_FIELDS, 'pool_usage')
-- A task record's fields the scripts act on (load_task()).
local TASK_FIELDS = {'state', 'tenant', 'tier', 'cost', 'node', 'gateway', 'deadline_us',
  'prompt_tokens', 'max_tokens', 'guest', 'charge', 'levels', 'quota_day', 'quota_month',
  'lift_epoch'}

-- What a capacity 429's retry hint is computed from (admission/hints.py), as admit.lua and
-- hint.lua report it: the tasks queued at `tier` or above; their drain rate in tasks/s, the sum
-- of the state's drain_<t> ('' when none was published); the state's age in ms at `now`
-- (µs), -1 when no state was published; and the tasks queued at `tier` itself. `st`: the state
-- hash's HINT_FIELDS, by name.
local function hint_facts(queues, tier, st, now)
  local ahead, drain, known, own = 0, 0, false, 0
  for t = 0, tier do
    own = redis.call('ZCARD', queues[t + 1])
    ahead = ahead + own
    local rate = st['drain_' .. t]
    if rate then
      known = true
      drain = drain + (tonumber(rate) or 0)
    end
  end
  local age = -1
  if st.updated_us then age = math.floor((now - tonumber(st.updated_us)) / 1000) end
  return ahead, known and tostring(drain) or '', age, own
end

local function task_key(prefix, id) return prefix .. 'task:' .. id end
local function bucket_key(prefix, tenant) return prefix .. 'bucket:' .. tenant end
local function gateway_key(prefix, gw) return prefix .. 'gateway:' .. gw end
local function running_key(prefix) return prefix .. 'running' end
local function guests_key(prefix) return prefix .. 'node_guests' end
local function pace_key(prefix) return prefix .. 'node_guest_pace' end
local function tenant_key(prefix, tenant) return prefix .. 'tenant:' .. tenant end
local function flows_key(prefix, tier) return prefix .. 'flows:' .. TIER_LABELS[tier + 1] end
local function flow_key(prefix, tier, tenant)
  return prefix .. 'flow:' .. TIER_LABELS[tier + 1] .. ':' .. tenant
end
local function vtime_key(prefix) return prefix .. 'vtime' end
local function quota_key(prefix, level) return prefix .. 'quota:' .. level end
local function light_key(prefix, tier) return prefix .. 'light:' .. TIER_LABELS[tier + 1] end
local function inflight_key(prefix) return prefix .. 'tenant_inflight' end

-- A released task's entry in the running index: what the scheduler needs to project how the
-- node's KV usage will grow (names never contain spaces: admission/keys.py check_name).
local function running_member(node, prompt_tokens, max_tokens, id)
  return node .. ' ' .. prompt_tokens .. ' ' .. max_tokens .. ' ' .. id
end

-- Lazily refilled level of a bucket at `now`, in micro-tokens; does not write.
-- A bucket that does not exist yet starts full.
local function bucket_level(bkey, now, rate, burst)
  local b = redis.call('HMGET', bkey, 'micro_tokens', 'updated_us')
  local cap = burst * 1000000
  local level = tonumber(b[1])
  local ts = tonumber(b[2])
  if level == nil or ts == nil then return cap end
  if now > ts then level = level + rate * (now - ts) end
  if level > cap then level = cap end
  return level
end

local function bucket_store(bkey, level, now, rate, burst)
  redis.call('HSET', bkey, 'micro_tokens', fmt(level), 'updated_us', fmt(now),
    'rate', fmt(rate), 'burst', fmt(burst))
end

-- Give `tokens` back to a tenant's bucket (negative takes more, never below zero), using the
-- rate and burst stored by its last admit so the scheduler's reaper needs no tenant config.
local function bucket_credit(bkey, now, tokens)
  local params = redis.call('HMGET', bkey, 'rate', 'burst')
  local rate = tonumber(params[1])
  local burst = tonumber(params[2])
  if rate == nil or burst == nil then return 0 end
  local level = bucket_level(bkey, now, rate, burst) + tokens * 1000000
  if level < 0 then level = 0 end
  if level > burst * 1000000 then level = burst * 1000000 end
  bucket_store(bkey, level, now, rate, burst)
  return tokens
end
