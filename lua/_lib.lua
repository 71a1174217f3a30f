-- _lib.lua: helpers prepended to every script at load time; not a script of its own.
--
-- Units used everywhere: times in microseconds of Redis TIME (in a test process only, the
-- pool clock's frozen_us when set, so that tests can stop and move time without sleeping:
-- TEST_CLOCK, defined on the line before this file by admission/scripts.py, is false in
-- every service, and then frozen_us is never read);
-- token amounts in whole tokens, except a bucket's level, kept in micro-tokens so that
-- refill (rate tokens/s x elapsed µs) stays an exact integer.
-- Dynamic key suffixes below mirror admission/keys.py (task:, bucket:, gateway:, running,
-- node_guests, node_guest_pace, tenant:, flows:, flow:, vtime, quota:, light:).

local TIER_QUEUE_COUNT = 3
local TIER_LABELS = {'vip', 'normal', 'batch'}
-- Virtual counter units per token served at weight 1 (admission/keys.py VT_SCALE).
local VT_SCALE = 1000
-- At most this many flows tied at the least counter are compared by the age of their heads.
local TIE_SCAN = 8
-- Time constant of a tenant's drain rate (the tokens released from its queue, decayed), µs.
local DRAIN_TAU_US = 5000000
-- The longest wait a drain rate is turned into (ms); the caller caps its hint lower.
local DRAIN_WAIT_MAX_MS = 1000000000
-- Headroom within 1/TIE_SHARE of the best node's counts as a tie (see place()).
local TIE_SHARE = 32
-- VIP goes to the quiet nodes whose engines run at most max(RUNNING_SLACK_MIN, RUNNING_SLACK x
-- the least) more sequences than the least busy of them (least_queued()).
local RUNNING_SLACK, RUNNING_SLACK_MIN = 0.25, 4
-- At most this many light tenants, and this many backlogged flows, make up the view a
-- release judges a tenant's share of the in-flight tokens against (fair_view()).
local LIGHT_SCAN = 8

local function fmt(n)
  return string.format('%.0f', n)
end

local function now_us(clock_key)
  if TEST_CLOCK then
    local frozen = redis.call('HGET', clock_key, 'frozen_us')
    if frozen then return tonumber(frozen) end
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
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

-- The state hash's fields that say where a task may run (placement_of()).
local PLACEMENT_FIELDS = {'dedicated_nodes', 'dedicated_tiers', 'dedicated_guest_prompt',
  'dedicated_guest_cap', 'dedicated_guest_rate', 'dedicated_guest_output',
  'dedicated_guests_closed', 'prefill_quiet'}
-- The state hash's fields a capacity 429's hint is computed from (hint_facts()).
local HINT_FIELDS = {'zone', 'updated_us', 'drain_0', 'drain_1', 'drain_2', 'red_clear_s'}
-- What admit.lua reads of the state hash: both of the above.
local ADMIT_STATE_FIELDS = {unpack(HINT_FIELDS)}
for _, name in ipairs(PLACEMENT_FIELDS) do table.insert(ADMIT_STATE_FIELDS, name) end
-- A task record's fields the scripts act on (load_task()).
local TASK_FIELDS = {'state', 'tenant', 'tier', 'cost', 'node', 'gateway', 'deadline_us',
  'prompt_tokens', 'max_tokens', 'guest', 'charge', 'levels', 'quota_day'}

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

-- Quota levels. A request debits its tenant's bucket (the key level, bucket_key()) and the
-- bucket of every enclosing level (a team, its organisation: quota_key()), all in the admit
-- call, and is refused when any of them cannot pay. Each level may also have a daily and a
-- monthly allowance of tokens (UTC days and months of Redis TIME), kept in its bucket's hash:
-- day (days since 1970-01-01) and day_used, month (year x 12 + month - 1) and month_used. A
-- task records the day it was admitted (quota_day) when an allowance applies, so that its
-- refund at the end goes back to that period only if it is still the current one.
local DAY_US = 86400000000

-- Year and month (1..12) of a day counted from 1970-01-01 (the proleptic Gregorian calendar,
-- by eras of 400 years).
local function civil_of(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The day (from 1970-01-01) of the first of month `m` (1..12) of year `y`.
local function first_of_month(y, m)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5)
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end

local function month_of_day(day)
  local y, m = civil_of(day)
  return y * 12 + m - 1
end

-- Tokens used so far in the current period of an allowance ('day' or 'month'), from a hash
-- read with HMGET day, day_used, month, month_used (`f`).
local function period_used(f, kind, index)
  local at, used = f[1], f[2]
  if kind == 'month' then at, used = f[3], f[4] end
  if tonumber(at) == index then return tonumber(used) or 0 end
  return 0
end

-- Why a level cannot pay `cost` now, as the ms until it can (-1: never, the bucket does not
-- refill) and the kind ('bucket', 'daily', 'monthly'), or nil when it can. `lvl`: {key, rate,
-- burst, daily, monthly}; sets lvl.level (micro-tokens at `now`).
local function level_short(lvl, now, cost)
  lvl.level = bucket_level(lvl.key, now, lvl.rate, lvl.burst)
  local need, wait, kind = cost * 1000000, nil, nil
  if lvl.level < need then
    wait, kind = -1, 'bucket'
    if lvl.rate > 0 then wait = math.ceil((need - lvl.level) / lvl.rate / 1000) end
  end
  if lvl.daily > 0 or lvl.monthly > 0 then
    local f = redis.call('HMGET', lvl.key, 'day', 'day_used', 'month', 'month_used')
    local day = math.floor(now / DAY_US)
    if lvl.daily > 0 and period_used(f, 'day', day) + cost > lvl.daily then
      local w = math.ceil(((day + 1) * DAY_US - now) / 1000)
      if wait == nil or (wait >= 0 and w > wait) then wait, kind = w, 'daily' end
    end
    if lvl.monthly > 0 then
      local y, m = civil_of(day)
      if period_used(f, 'month', y * 12 + m - 1) + cost > lvl.monthly then
        if m == 12 then y, m = y + 1, 1 else m = m + 1 end
        local w = math.ceil((first_of_month(y, m) * DAY_US - now) / 1000)
        if wait == nil or (wait >= 0 and w > wait) then wait, kind = w, 'monthly' end
      end
    end
  end
  return wait, kind
end

-- A level pays `cost`: its bucket is debited and its allowances count it.
local function level_debit(lvl, now, cost)
  bucket_store(lvl.key, lvl.level - cost * 1000000, now, lvl.rate, lvl.burst)
  if lvl.daily > 0 or lvl.monthly > 0 then
    local f = redis.call('HMGET', lvl.key, 'day', 'day_used', 'month', 'month_used')
    local day = math.floor(now / DAY_US)
    local month = month_of_day(day)
    redis.call('HSET', lvl.key, 'day', fmt(day), 'day_used',
      fmt(period_used(f, 'day', day) + cost), 'month', fmt(month), 'month_used',
      fmt(period_used(f, 'month', month) + cost))
  end
end

-- Give `tokens` back to a level (negative takes more): its bucket, and its allowances when the
-- task was admitted in the current period (`task_day`: the day it was admitted, or nil).
local function level_credit(key, now, tokens, task_day)
  bucket_credit(key, now, tokens)
  if task_day == nil then return end
  local f = redis.call('HMGET', key, 'day', 'day_used', 'month', 'month_used')
  local day = math.floor(now / DAY_US)
  if task_day == day and tonumber(f[1]) == day then
    redis.call('HSET', key, 'day_used', fmt(math.max(0, (tonumber(f[2]) or 0) - tokens)))
  end
  local month = month_of_day(day)
  if month_of_day(task_day) == month and tonumber(f[3]) == month then
    redis.call('HSET', key, 'month_used', fmt(math.max(0, (tonumber(f[4]) or 0) - tokens)))
  end
end

-- A task's tenant and enclosing levels get `tokens` back (its record's levels: names,
-- space-separated).
local function task_credit(prefix, task, now, tokens)
  local task_day = tonumber(task.quota_day)
  level_credit(bucket_key(prefix, task.tenant), now, tokens, task_day)
  if task.levels then
    for name in string.gmatch(task.levels, '%S+') do
      level_credit(quota_key(prefix, name), now, tokens, task_day)
    end
  end
end

-- Dedicated nodes, as the scheduler publishes them in the state hash: 'dedicated_nodes' (names,
-- space-separated) serve the tiers in 'dedicated_tiers' (bit 2^tier: 1 VIP, 2 Normal,
-- 4 Batch), and of the other tiers only guests: tasks whose prompt is at most
-- 'dedicated_guest_prompt' tokens, at most 'dedicated_guest_cap' of them alive on each such
-- node at once (both 0 or absent: no guests), with 'dedicated_guest_output' > 0 only those
-- asking for at most that many output tokens, and with 'dedicated_guest_rate' > 0 paced by
-- their prompts: after a guest of p prompt tokens the node takes no other guest for
-- p / rate seconds. 'dedicated_guests_closed' (names): dedicated nodes that take no guests
-- now (their engines run more sequences than the pool allows guests beside). Absent fields:
-- every node is shared.
-- `st`: the state hash's PLACEMENT_FIELDS, by name (hash_fields()).
local function placement_of(st)
  local nodes = {}
  if st.dedicated_nodes then
    for node in string.gmatch(st.dedicated_nodes, '%S+') do nodes[node] = true end
  end
  local closed = {}
  if st.dedicated_guests_closed then
    for node in string.gmatch(st.dedicated_guests_closed, '%S+') do closed[node] = true end
  end
  return {nodes = nodes, tiers = tonumber(st.dedicated_tiers or '0') or 0, closed = closed,
          guest_prompt = tonumber(st.dedicated_guest_prompt or '0') or 0,
          guest_cap = tonumber(st.dedicated_guest_cap or '0') or 0,
          guest_rate = tonumber(st.dedicated_guest_rate or '0') or 0,
          guest_output = tonumber(st.dedicated_guest_output or '0') or 0,
          quiet = tonumber(st.prefill_quiet or '0') or 0}
end

-- Prefill room: how many prompt tokens of Normal and Batch work each node may still be given
-- before a VIP chat's first token would wait behind too much prefill (scheduler/control.py).
-- The leader publishes, per node, an absolute limit on the node's count of such prompt tokens
-- released so far (`node_prefill` field <node>; the count is `node_prefill_released` <node>,
-- which every Normal or Batch placement raises by its prompt) and the node's window
-- (`node_prefill` field <node>:window, the most the room can be). Absolute, so that releases
-- made between the leader's read and its publish count against the new limit: exact across
-- gateways. A node without a published limit is not limited.
--
-- Between two polls the room refills as the node prefills: the leader also publishes each
-- node's measured prefill rate (<node>:rate, tokens/s; 0 while the node must take nothing) and
-- the Redis time of the publish (`:at`, µs) and until when the rooms may refill (`:until`, µs,
-- a few polls later: a leader that stopped publishing stops the refill). A room then grows by
-- rate x (now - :at), up to the window: what the node prefilled since the publish, as the
-- leader's next measurement would find it, were the node prefilling at its measured rate. Work
-- flows at the node's prefill rate rather than one window per poll (on a fast node, or with a
-- slow poll, the window drains long before the next one); a node that prefilled more slowly
-- has a longer backlog than the room assumed, by at most rate x (the poll and the scrape's age),
-- which the next poll's measured backlog takes back.
-- KEYS the caller passes for it: node_prefill HASH (<node> -> limit, tokens; <node>:window ->
-- tokens; <node>:rate -> tokens/s; <node>:running -> sequences; :at, :until -> µs) and
-- node_prefill_released HASH (<node> -> prompt tokens of Normal and Batch work released there
-- so far). `now`: µs, Redis TIME.
local function prefill_of(limits_key, released_key, now)
  local f = redis.call('HMGET', limits_key, ':at', ':until')
  local at, till = tonumber(f[1]), tonumber(f[2])
  local refill_s = 0
  if at and till then refill_s = math.max(0, math.min(now, till) - at) / 1000000 end
  return {limits_key = limits_key, released_key = released_key, refill_s = refill_s,
          idle = {}}
end

-- {room = tokens left (may be negative), window = tokens, running = the engine's running
-- sequences at the leader's last scrape (nil: not published)} of a node, or nil when
-- unlimited.
-- A refill beyond the window is prefill time the node spent idle, which cannot be banked:
-- prefill_taken() lowers the limit by it (`prefill.idle`) when the node takes work, so that
-- the room after the placement is the window less what was placed, at any later time.
local function prefill_room(prefill, node)
  local f = redis.call('HMGET', prefill.limits_key, node, node .. ':window', node .. ':rate',
    node .. ':running')
  local limit = tonumber(f[1])
  if limit == nil then return nil end
  local released = tonumber(redis.call('HGET', prefill.released_key, node) or '0') or 0
  local room, window = limit - released, tonumber(f[2]) or 0
  local refill = math.floor((tonumber(f[3]) or 0) * prefill.refill_s)
  prefill.idle[node] = nil
  if refill > 0 and room < window then
    if room + refill > window then prefill.idle[node] = room + refill - window end
    room = math.min(window, room + refill)
  end
  return {room = room, window = window, running = tonumber(f[4])}
end

-- A prompt fits the room it takes; one larger than the room fits a room at least half the
-- window (at most half a window queued for prefill on the node), or long documents would
-- never run on a node that always has a chat or two to prefill.
-- Light tenants (fair order holding room back, fair_view()): a flooding tenant's releases take
-- the room as fast as the leader publishes it, and a tenant sending within its share would
-- wait a poll for each request. So while it must hold room back (`held`), a release leaves at
-- least a token of the room (a prompt that would spend it exactly waits, the long document's
-- rule aside), and a light tenant's request (`light`: its fast path beside others' backlog,
-- or its release ahead of the counters' order, light_flow()) may take the room down to minus
-- two windows (light requests arriving together each pass, not only the first one after a
-- refill: a flood's releases take every refill). The overdraw is counted (prefill_taken())
-- and the leader takes it out of the rooms it publishes next, so that it reorders work rather
-- than adding it; the queue ahead of a VIP chat is then at most three windows for a poll.
-- Returns whether it fits, and whether it is a long prefill: larger than the room and than
-- twice the window (its prefill alone takes the whole objective; see quiet_others()).
local function prefill_fits(compute, prompt_tokens, light, held)
  if compute == nil then return true, false end
  local room = compute.room
  if prompt_tokens < room or (prompt_tokens == room and not held) then return true, false end
  local long = prompt_tokens > 2 * compute.window
  if light then return room - prompt_tokens >= -2 * compute.window, long end
  return room > 0 and 2 * room >= compute.window, long
end

-- A node is quiet while its prefill room is at least half its window (at most half a window
-- of other tiers' prompts queued ahead of a VIP chat; a node without a published room counts
-- as quiet): VIP is steered to quiet nodes (least_queued()).
local function is_quiet(compute)
  return compute == nil or 2 * compute.room >= compute.window
end

-- Quiet nodes kept (`placement.quiet`, the state's prefill_quiet, published from
-- [pools.control] quiet_nodes): a long prefill (prefill_fits()'s second result: a prompt
-- larger than the room whose prefill alone takes the whole objective the window is half of)
-- may go to a node only while that many other nodes with capacity for its tier stay quiet,
-- at most all but one of them (a one-node pool still runs long documents). With every node
-- running a long prefill, a VIP chat that arrives waits for one of them to finish, however
-- short the other tiers' windows: an 8k-token document is seconds of prefill on a slice of
-- a GPU, and the engine computes the running prompt's chunks before a waiting chat's. One
-- quiet node caps that wait at half a window while the others take the documents
-- (takes_prompt() lets them queue a second one each, to prefill documents back to back).
-- `computes`: node -> its room, or false when none is published.
local function quiet_others(computes, node)
  local n = 0
  for other, compute in pairs(computes) do
    if other ~= node and is_quiet(compute or nil) then n = n + 1 end
  end
  return n
end

-- Whether `node` (its room `compute`) takes a Normal or Batch prompt: prefill_fits(), and for
-- a long prefill while `need` quiet nodes are kept, only while that many others stay quiet,
-- and then also queued behind another long prefill (the node's queue beyond its window less
-- than this prompt): the nodes the documents go to prefill them back to back instead of
-- idling until the leader's next poll sees the last one done, and only Normal and Batch work
-- waits behind them.
local function takes_prompt(compute, computes, need, node, prompt_tokens, light, held)
  local fits, long = prefill_fits(compute, prompt_tokens, light, held)
  if long and need > 0 then
    return (fits or compute.room + prompt_tokens >= 0) and quiet_others(computes, node) >= need
  end
  return fits
end

-- A placement of `prompt_tokens` on `node` takes its room; one that only the light rule let
-- through also counts what it took beyond `light_room`, the room place() found there
-- (<node>:light), which the leader takes out of the rooms it publishes next
-- (scheduler.control.take_overdraw). `light_room` nil: not such a placement (place()'s third
-- result).
local function prefill_taken(prefill, tier, node, prompt_tokens, light_room)
  -- (A record without a prompt count, which only an older version could leave, adds none.)
  if prefill and tier > 0 and prompt_tokens < math.huge then
    if prefill.idle[node] then
      redis.call('HINCRBY', prefill.limits_key, node, -prefill.idle[node])
      prefill.idle[node] = nil
    end
    if light_room and prompt_tokens > light_room then
      redis.call('HINCRBY', prefill.released_key, node .. ':light',
        prompt_tokens - math.max(light_room, 0))
    end
    redis.call('HINCRBY', prefill.released_key, node, prompt_tokens)
  end
end

-- VIP's candidates (rows {node, kv room, reserved, prefill room: prefill_room(), nil when
-- none is published}): the quiet ones, whose prefill room is at least half their window (a
-- short compute queue ahead of the chat's first token; a node without a published room counts
-- as such), if one of them has KV room for it, else the ones with the most prefill room; the
-- KV rules of place() then choose among them. Among the quiet ones with KV room, only those
-- whose engine runs at most RUNNING_SLACK more sequences than the least busy (the leader
-- publishes the scraped count):
-- every step of a decode batch costs time per sequence, and the chat's first token waits for
-- a step or two of it, so the most KV headroom is the wrong choice where it sits beside the
-- longest batch (long generations fill a node's batch long before its cache).
-- Returns the candidates and best KV room per group (unchanged when no row qualifies).
local function least_queued(candidates, best, cost)
  local function pick(keep)
    local out, top, any = {{}, {}}, {}, false
    for group = 1, 2 do
      for _, c in ipairs(candidates[group]) do
        if keep(c) then
          table.insert(out[group], c)
          if top[group] == nil or c[2] > top[group] then top[group] = c[2] end
          if c[2] >= cost then any = true end
        end
      end
    end
    return any and out, top
  end
  local function running(c) return c[4] and c[4].running end
  local out, top = pick(function(c) return is_quiet(c[4]) end)
  if out then
    local least = nil
    for group = 1, 2 do
      for _, c in ipairs(out[group]) do
        local n = running(c)
        if c[2] >= cost and n and (least == nil or n < least) then least = n end
      end
    end
    if least then
      local most = least + math.max(RUNNING_SLACK_MIN, math.ceil(least * RUNNING_SLACK))
      local idle, idle_top = pick(function(c)
        return is_quiet(c[4]) and (running(c) or 0) <= most end)
      if idle then return idle, idle_top end
    end
    return out, top
  end
  -- No quiet node has KV room for it (so every node considered has a published room).
  local most = nil
  for group = 1, 2 do
    for _, c in ipairs(candidates[group]) do
      if c[2] >= cost and c[4] and (most == nil or c[4].room > most) then most = c[4].room end
    end
  end
  if most == nil then return candidates, best end
  out, top = pick(function(c) return c[4] ~= nil and c[4].room >= most end)
  return out, top
end

-- The node for a task of `tier` that needs `cost` tokens, or nil when none has room, and
-- whether it goes there as a guest: the most headroom (capacity - reserved) among the nodes
-- the task may use, dedicated nodes first (for the tiers they serve, and for guests: a node
-- dedicated to VIP that takes short work of other tiers must get it before the shared nodes do,
-- or it never fills its guest slots). `cap_key` is the task's tier's own capacity hash: each
-- tier is placed up to its own ceiling on the node's projected KV. With `guests_only`, the
-- task may go only to a dedicated node as a
-- guest (the scheduler's YELLOW release of Batch: the zone holds it off the shared nodes).
--
-- Ties share the load. A node ties with the best when its headroom is less than `cost` or
-- 1/TIE_SHARE of the best's headroom below it (and it has room for the task): a difference
-- smaller than the task is one this very placement would reverse, and budgets are measured
-- figures (each engine's profiled KV size, scraped usage, a paged-KV block of padding per
-- sequence) that differ by a few tokens or a percent between identical nodes. The strict best
-- (by a token, or by name on an exact tie) would take every request that finds the pool
-- idle, so a stream of short requests would all go to one node. Among tied nodes the least
-- reserved wins (the one running less of ours), and among those, in name order, the one whose
-- turn it is: the pool's count of releases so far (`stats_key` released_0..2, which every
-- placement advances by one) modulo their number. Deterministic, so every replica picks the
-- same node, and it needs no state beyond the counters the scheduler already reads.
--
-- Prefill room (`prefill`, see prefill_of(); nil: none published). A task of Normal or Batch
-- goes only to a node whose prefill room takes its prompt (prefill_fits()); VIP is never held
-- by it, but is steered to the nodes with the most prefill room
-- (a short compute queue ahead of its first token: least_queued()), and the KV rules below
-- choose among those.
--
-- Held-back room (`keep`, a fraction; nil or 0: none): the task may use a node only while
-- keep x the tier's capacity there stays free after it (fair release of a tenant above its
-- share while lighter tenants are active: fair_view()), and a token of the prefill room;
-- `light`: a light tenant's fast path, which may overdraw the prefill room (prefill_fits()).
-- Returns the node (nil: none), whether as a guest, and the node's prefill room before this
-- placement when only the light rule let the prompt through (an overdraw; nil otherwise, and
-- when no room is published), for prefill_taken().
local function place(cap_key, resv_key, gst_key, pc_key, stats_key, placement, tier, cost,
                     prompt_tokens, now, guests_only, prefill, keep, light)
  local caps = redis.call('HGETALL', cap_key)
  local owns_dedicated = math.floor(placement.tiers / 2 ^ tier) % 2 == 1
  local may_guest = not owns_dedicated and placement.guest_cap > 0
    and prompt_tokens <= placement.guest_prompt
    and (placement.guest_output == 0 or cost - prompt_tokens <= placement.guest_output)
  local candidates = {{}, {}}
  local best = {}
  local pf_rooms = {}
  -- Each node's prefill room, read once (false: none published).
  local rooms = {}
  local function room_of(node)
    if rooms[node] == nil then rooms[node] = prefill_room(prefill, node) or false end
    return rooms[node] or nil
  end
  -- Rooms of the nodes with capacity for the tier, when long prefills must leave quiet nodes.
  local computes, need = nil, 0
  if prefill and tier > 0 and placement.quiet > 0 then
    computes = {}
    local n = 0
    for i = 1, #caps, 2 do
      if (tonumber(caps[i + 1]) or 0) > 0 then
        computes[caps[i]] = room_of(caps[i]) or false
        n = n + 1
      end
    end
    need = math.min(placement.quiet, n - 1)
  end
  for i = 1, #caps, 2 do
    local node = caps[i]
    local group = placement.nodes[node] and 1 or 2
    local allowed = (group == 2 or owns_dedicated) and not guests_only
    if group == 1 and not allowed and may_guest and not placement.closed[node] then
      allowed = (tonumber(redis.call('HGET', gst_key, node) or '0') or 0) < placement.guest_cap
      if allowed and placement.guest_rate > 0 then
        allowed = (tonumber(redis.call('HGET', pc_key, node) or '0') or 0) <= now
      end
    end
    local compute, overdraw = nil, false
    if allowed and prefill then
      compute = room_of(node)
      if tier > 0 then
        local held = keep ~= nil and keep > 0
        allowed = takes_prompt(compute, computes, need, node, prompt_tokens, light, held)
        -- Only what the light rule alone let through is an overdraw (prefill_taken()).
        overdraw = light and allowed
          and not takes_prompt(compute, computes, need, node, prompt_tokens, false, held)
      end
    end
    if allowed then
      local reserved = tonumber(redis.call('HGET', resv_key, node) or '0') or 0
      local cap = tonumber(caps[i + 1]) or 0
      local room = cap - reserved
      if keep and keep > 0 and cap > 0 then room = room - math.floor(keep * cap) end
      table.insert(candidates[group], {node, room, reserved, compute})
      pf_rooms[node] = overdraw and compute.room or nil
      if best[group] == nil or room > best[group] then best[group] = room end
    end
  end
  if tier == 0 and prefill then candidates, best = least_queued(candidates, best, cost) end
  for group = 1, 2 do
    if best[group] and best[group] >= cost then
      local margin = math.max(cost, math.floor(best[group] / TIE_SHARE), 1)
      local tied, least = {}, nil
      for _, c in ipairs(candidates[group]) do
        if c[2] >= cost and best[group] - c[2] < margin then
          if least == nil or c[3] < least then
            tied, least = {c[1]}, c[3]
          elseif c[3] == least then
            table.insert(tied, c[1])
          end
        end
      end
      local node = tied[1]
      if #tied > 1 then
        table.sort(tied)
        local n = redis.call('HMGET', stats_key, 'released_0', 'released_1', 'released_2')
        local turn = (tonumber(n[1]) or 0) + (tonumber(n[2]) or 0) + (tonumber(n[3]) or 0)
        node = tied[turn % #tied + 1]
      end
      return node, group == 1 and not owns_dedicated, pf_rooms[node]
    end
  end
  return nil, false
end

-- A task released as a guest holds one of its node's guest slots until it ends, and on a
-- paced node puts off the next guest by its prompt's share of the rate (from now, or from the
-- time the node was already paced to, whichever is later).
local function guest_joined(gst_key, pc_key, placement, tkey, node, prompt_tokens, now)
  redis.call('HINCRBY', gst_key, node, 1)
  redis.call('HSET', tkey, 'guest', '1')
  if placement.guest_rate > 0 then
    local from = math.max(now, tonumber(redis.call('HGET', pc_key, node) or '0') or 0)
    redis.call('HSET', pc_key, node,
      fmt(from + math.floor(prompt_tokens * 1000000 / placement.guest_rate)))
  end
end

local function reserve_node(resv_key, node, cost)
  redis.call('HINCRBY', resv_key, node, cost)
end

local function unreserve_node(resv_key, node, cost)
  local left = redis.call('HINCRBY', resv_key, node, -cost)
  if left <= 0 then redis.call('HDEL', resv_key, node) end
end

-- A tenant's tokens reserved by its released, unfinished tasks (`inflight_tokens` in its hash).
local function inflight_add(prefix, tenant, cost)
  redis.call('HINCRBY', tenant_key(prefix, tenant), 'inflight_tokens', cost)
end

-- A tenant's drain: the tokens released from its queue, each decayed by exp(-age / DRAIN_TAU_US)
-- (`drain`, with `drain_us` when it was last decayed); drain / tau is its rate in tokens/s.
local function drain_now(tkey, now)
  local f = redis.call('HMGET', tkey, 'drain', 'drain_us')
  local sum, at = tonumber(f[1]), tonumber(f[2])
  if sum == nil or at == nil then return nil end
  if now > at then sum = sum * math.exp(-(now - at) / DRAIN_TAU_US) end
  return sum
end

local function drain_add(tkey, now, tokens)
  local sum = (drain_now(tkey, now) or 0) + tokens
  redis.call('HSET', tkey, 'drain', string.format('%.17g', sum), 'drain_us', fmt(now))
end

-- The ms until `excess` more tokens of a tenant's queue have drained at its drain rate;
-- -1 when it has never drained (unknown), DRAIN_WAIT_MAX_MS at most (a rate of 0).
local function drain_wait_ms(tkey, now, excess)
  local sum = drain_now(tkey, now)
  if sum == nil then return -1 end
  local rate = sum * 1000000 / DRAIN_TAU_US
  if rate * DRAIN_WAIT_MAX_MS <= excess * 1000 then return DRAIN_WAIT_MAX_MS end
  return math.ceil(excess * 1000 / rate)
end

-- Whether a task of `cost` fits under its tenant's cap on in-flight tokens (`inflight_cap` in
-- the hash, set by its admits; absent or 0: none).
local function inflight_fits(tkey, cost, cap)
  if cap == nil then cap = tonumber(redis.call('HGET', tkey, 'inflight_cap') or '0') or 0 end
  if cap <= 0 then return true end
  return (tonumber(redis.call('HGET', tkey, 'inflight_tokens') or '0') or 0) + cost <= cap
end

local function inflight_done(prefix, tenant, cost)
  local tkey = tenant_key(prefix, tenant)
  if redis.call('HINCRBY', tkey, 'inflight_tokens', -cost) <= 0 then
    redis.call('HDEL', tkey, 'inflight_tokens')
  end
end

local function tenant_dequeued(tq_key, tenant)
  local left = redis.call('HINCRBY', tq_key, tenant, -1)
  if left <= 0 then redis.call('HDEL', tq_key, tenant) end
end

-- Fair release within a tier (docs/architecture.md, "Fairness within a tier"). Each tenant
-- has a virtual counter per tier (vt_<tier> in its hash, tenant_key()): the weighted tokens
-- it was served there. A task released from the queue charges its tenant
-- floor(cost x VT_SCALE / weight) (at least 1; the task records the charge), and its settle
-- takes back the part of the charge it did not use, so service counts real tokens, as the
-- virtual token counter of fair LLM serving does. Fair release serves the head (oldest task)
-- of the backlogged flow with the least counter; among up to TIE_SCAN flows tied at it, the
-- oldest head. A flow that becomes backlogged is lifted to the least counter of the tier's
-- backlogged flows, or to the tier's virtual time (the counter the last flow was served at)
-- when none is: idle time banks no credit. The flows ZSET mirrors the counters of the
-- backlogged tenants so that the least is one ZRANGE away.

local function tenant_vt(tkey, tier)
  return tonumber(redis.call('HGET', tkey, 'vt_' .. tier) or '0') or 0
end

-- The least counter of `tier`'s backlogged flows and true, or the tier's virtual time and false.
local function flow_floor(prefix, tier)
  local least = redis.call('ZRANGE', flows_key(prefix, tier), 0, 0, 'WITHSCORES')
  if least[1] then return tonumber(least[2]), true end
  return tonumber(redis.call('HGET', vtime_key(prefix), TIER_LABELS[tier + 1]) or '0') or 0, false
end

-- The counter after the lift a flow gets as it becomes backlogged (written back when raised).
local function flow_lift(prefix, tier, tkey)
  local floor = flow_floor(prefix, tier)
  local own = tenant_vt(tkey, tier)
  if own < floor then
    own = floor
    redis.call('HSET', tkey, 'vt_' .. tier, fmt(own))
  end
  return own
end

-- A task queued at `score` (µs) joins its tenant's flow; the tenant's queued tokens grow by its
-- cost; an empty flow becomes backlogged, lifted.
local function flow_join(prefix, tier, tenant, id, score, cost)
  local fkey = flow_key(prefix, tier, tenant)
  local tkey = tenant_key(prefix, tenant)
  redis.call('ZADD', fkey, fmt(score), id)
  redis.call('HINCRBY', tkey, 'queued_tokens', cost)
  if redis.call('ZCARD', fkey) == 1 then
    redis.call('ZADD', flows_key(prefix, tier), fmt(flow_lift(prefix, tier, tkey)), tenant)
  end
end

-- A queued task leaves its tenant's flow (released, cancelled, expired, reaped); a flow left
-- empty is no longer backlogged (its counter stays in the tenant's hash).
local function flow_leave(prefix, tier, tenant, id, cost)
  local fkey = flow_key(prefix, tier, tenant)
  local tkey = tenant_key(prefix, tenant)
  redis.call('ZREM', fkey, id)
  if redis.call('EXISTS', fkey) == 0 then redis.call('ZREM', flows_key(prefix, tier), tenant) end
  if redis.call('HINCRBY', tkey, 'queued_tokens', -cost) <= 0 then
    redis.call('HDEL', tkey, 'queued_tokens')
  end
end

-- A counter moved by `delta` units, and its mirror in the flows ZSET while backlogged.
local function vt_add(prefix, tier, tenant, delta)
  local after = redis.call('HINCRBY', tenant_key(prefix, tenant), 'vt_' .. tier, fmt(delta))
  if redis.call('ZSCORE', flows_key(prefix, tier), tenant) then
    redis.call('ZADD', flows_key(prefix, tier), fmt(after), tenant)
  end
end

-- A task of `cost` tokens served from `tenant`'s flow of `tier` (after flow_leave(), or on a
-- busy tier's fast path after the lift): the tier's virtual time becomes the counter it was
-- served at, the counter grows by the charge. Returns the charge (VT units).
local function flow_charge(prefix, tier, tenant, cost)
  local tkey = tenant_key(prefix, tenant)
  local weight = tonumber(redis.call('HGET', tkey, 'weight') or '1') or 1
  if weight <= 0 then weight = 1 end
  local charge = math.max(1, math.floor(cost * VT_SCALE / weight))
  local label = TIER_LABELS[tier + 1]
  local served_at = tenant_vt(tkey, tier)
  local vtime = tonumber(redis.call('HGET', vtime_key(prefix), label) or '0') or 0
  if served_at > vtime then redis.call('HSET', vtime_key(prefix), label, fmt(served_at)) end
  vt_add(prefix, tier, tenant, charge)
  return charge
end

-- A released task that was charged ends: the charge's share of what it did not use comes back
-- (usage < 0: unknown, treated as none used, as its tenant's bucket is refunded); usage above
-- the reservation adds to the counter.
local function flow_settle(prefix, task, usage)
  local charge, cost = tonumber(task.charge), tonumber(task.cost)
  if not charge or not cost or cost <= 0 then return end
  local unused = cost
  if usage >= 0 then unused = cost - usage end
  local back = math.floor(charge * unused / cost)
  if back ~= 0 then vt_add(prefix, tonumber(task.tier), task.tenant, -back) end
end

-- The next flow of `tier` to serve, skipping the tenants in `skip` (`nskip` of them): tenant,
-- head task id and its enqueue score (string), or nil when no flow is left. A listed flow found
-- empty (only a bug or a manual edit leaves one) is dropped from the list.
local function next_flow(prefix, tier, skip, nskip)
  local list = flows_key(prefix, tier)
  while true do
    local rows = redis.call('ZRANGE', list, 0, nskip + TIE_SCAN - 1, 'WITHSCORES')
    local best, best_id, best_at, best_score, least, ties, stale = nil, nil, nil, nil, nil, 0, false
    for i = 1, #rows, 2 do
      local tenant = rows[i]
      if not skip[tenant] then
        local score = tonumber(rows[i + 1])
        if least == nil then least = score elseif score > least then break end
        local head = redis.call('ZRANGE', flow_key(prefix, tier, tenant), 0, 0, 'WITHSCORES')
        if not head[1] then
          redis.call('ZREM', list, tenant)
          stale = true
          break
        end
        local at = tonumber(head[2])
        if best == nil or at < best_at then
          best, best_id, best_at, best_score = tenant, head[1], at, head[2]
        end
        ties = ties + 1
        if ties >= TIE_SCAN then break end
      end
    end
    if not stale then return best, best_id, best_score end
  end
end

-- Held-back room for light tenants (docs/architecture.md, "Fairness within a tier"). Fair
-- order decides who is served next, but it is work-conserving: every token a completion frees
-- goes to the backlog, so a tenant sending within its share finds its nodes full of a flooding
-- tenant's work and waits for the next completion, where alone it would have been admitted at
-- once. A tenant admitted with nothing of its own queued while its tier has backlogged flows
-- is light (light:<tier>, ZSET tenant -> µs of that admit), whether the fast path released it
-- or it queued (then it had found no room: the mark is what makes room for its next requests).
-- For a window after that admit, a release from the queue of
-- a tenant holding more than its weighted share of the in-flight tokens of the tier's active
-- tenants (the light ones and the backlogged ones) leaves a fraction of each node's capacity
-- free (place()'s keep), which the light tenants' next requests take on the fast path. With
-- every tenant backlogged no one is light and release stays work-conserving; a tenant never
-- holds room back from itself alone.

-- A member of a release call's view: its in-flight tokens and weight, added to the sums once.
local function new_view()
  return {light = {}, order = {}, nlight = 0, members = {}, total = 0, wsum = 0}
end

-- Whether member `m` holds no more than its weighted share of the view's in-flight tokens.
local function within_share(view, m)
  return m.inflight * view.wsum <= m.weight * view.total
end

local function fair_member(prefix, view, tenant)
  local m = view.members[tenant]
  if m then return m end
  local row = redis.call('HMGET', tenant_key(prefix, tenant), 'inflight_tokens', 'weight')
  local weight = tonumber(row[2] or '1') or 1
  if weight <= 0 then weight = 1 end
  m = {inflight = tonumber(row[1] or '0') or 0, weight = weight}
  view.members[tenant] = m
  view.total = view.total + m.inflight
  view.wsum = view.wsum + m.weight
  return m
end

-- The view one release call judges shares by, for `tier`: the light tenants of the last
-- `window_us` (older entries are dropped here), up to LIGHT_SCAN of them, most recent first,
-- then up to LIGHT_SCAN backlogged flows, least counter first. No light tenant: an empty view.
local function fair_view(prefix, tier, now, window_us)
  local lkey = light_key(prefix, tier)
  redis.call('ZREMRANGEBYSCORE', lkey, '-inf', '(' .. fmt(now - window_us))
  local light = redis.call('ZREVRANGE', lkey, 0, LIGHT_SCAN - 1)
  local view = new_view()
  view.order, view.nlight = light, #light
  if #light == 0 then return view end
  for _, tenant in ipairs(light) do
    view.light[tenant] = true
    fair_member(prefix, view, tenant)
  end
  for _, tenant in ipairs(redis.call('ZRANGE', flows_key(prefix, tier), 0, LIGHT_SCAN - 1)) do
    fair_member(prefix, view, tenant)
  end
  return view
end

-- The room `tenant`'s next release must leave free (a fraction of each node's capacity): `keep`
-- when a light tenant other than itself is in the view and it holds more than its weighted
-- share of the view's in-flight tokens, else 0.
local function fair_keep(prefix, view, tenant, keep)
  if view.nlight == 0 or (view.nlight == 1 and view.light[tenant]) then return 0 end
  if within_share(view, fair_member(prefix, view, tenant)) then return 0 end
  return keep
end

-- The light tenant a release call serves first in `tier`: among the view's light tenants with
-- work queued there, not in `skip`, and holding no more than their weighted share of the view's
-- in-flight tokens, the one whose oldest task is oldest: tenant, head id and its score, or nil.
local function light_flow(prefix, tier, view, skip)
  local best, best_id, best_at, best_score = nil, nil, nil, nil
  for _, tenant in ipairs(view.order) do
    if not skip[tenant] then
      local head = redis.call('ZRANGE', flow_key(prefix, tier, tenant), 0, 0, 'WITHSCORES')
      if head[1] then
        local at = tonumber(head[2])
        if within_share(view, fair_member(prefix, view, tenant))
            and (best == nil or at < best_at) then
          best, best_id, best_at, best_score = tenant, head[1], at, head[2]
        end
      end
    end
  end
  return best, best_id, best_score
end

-- A release of `cost` tokens to `tenant` in this call, counted in the view.
local function fair_served(view, tenant, cost)
  local m = view.members[tenant]
  if m then
    m.inflight = m.inflight + cost
    view.total = view.total + cost
  end
end

-- Whether `tenant` (of `weight`, as its request states it) holds no more than its weighted
-- share of the in-flight tokens of itself and the tier's backlogged flows (up to LIGHT_SCAN,
-- least counter first): a light tenant's fast path need not wait behind a heavier tenant
-- whose counter happens to be lower (its own ran one request ahead in a burst); the counters
-- keep ordering the backlog.
local function under_share(prefix, tier, tenant, weight)
  local view = new_view()
  local w = tonumber(weight) or 1
  if w <= 0 then w = 1 end
  local own = tonumber(redis.call('HGET', tenant_key(prefix, tenant), 'inflight_tokens') or '0')
    or 0
  local me = {inflight = own, weight = w}
  view.members[tenant] = me
  view.total, view.wsum = own, w
  for _, other in ipairs(redis.call('ZRANGE', flows_key(prefix, tier), 0, LIGHT_SCAN - 1)) do
    fair_member(prefix, view, other)
  end
  return within_share(view, me)
end

-- Move a task to a terminal state and let its record expire after `retention_s`, so a late
-- settle or cancel still finds it and does nothing.
local function task_finish(tkey, state, now, retention_s, extra)
  redis.call('HSET', tkey, 'state', state, 'finished_us', fmt(now))
  if extra then redis.call('HSET', tkey, unpack(extra)) end
  redis.call('EXPIRE', tkey, retention_s)
end

-- A queued task leaves its queue without being released: the tenant gets its whole
-- reservation back.
local function drop_queued(prefix, queues, deadlines_key, tq_key, id, task, state, now, retention_s)
  redis.call('ZREM', queues[tonumber(task.tier) + 1], id)
  redis.call('ZREM', deadlines_key, id)
  tenant_dequeued(tq_key, task.tenant)
  flow_leave(prefix, tonumber(task.tier), task.tenant, id, tonumber(task.cost))
  redis.call('SREM', gateway_key(prefix, task.gateway), id)
  task_credit(prefix, task, now, tonumber(task.cost))
  task_finish(task_key(prefix, id), state, now, retention_s)
end

-- A released task ends: the pool gets its reservation back and the tenant the unused part.
-- usage < 0 means "unknown, charge nothing" (the client never got an answer). Only a task that
-- ran to its end ('settled') teaches the pool how much of a reservation work uses: one cut
-- short (client gone, node failed) says nothing about that, and a wave of failures would
-- otherwise teach the scheduler to overcommit just as the fleet is in trouble.
local function drop_released(prefix, resv_key, stats_key, id, task, state, usage, now, retention_s)
  local cost = tonumber(task.cost)
  unreserve_node(resv_key, task.node, cost)
  if task.guest then
    local left = redis.call('HINCRBY', guests_key(prefix), task.node, -1)
    if left <= 0 then redis.call('HDEL', guests_key(prefix), task.node) end
  end
  redis.call('ZREM', running_key(prefix),
    running_member(task.node, task.prompt_tokens, task.max_tokens, id))
  redis.call('SREM', gateway_key(prefix, task.gateway), id)
  local refund = cost
  if usage >= 0 then refund = cost - usage end
  inflight_done(prefix, task.tenant, cost)
  flow_settle(prefix, task, usage)
  if usage >= 0 and state == 'settled' then
    redis.call('HINCRBY', stats_key, 'settled', 1)
    redis.call('HINCRBY', stats_key, 'settled_cost', cost)
    redis.call('HINCRBY', stats_key, 'settled_usage', usage)
  end
  task_credit(prefix, task, now, refund)
  local extra = nil
  if usage >= 0 then extra = {'usage', fmt(usage)} end
  task_finish(task_key(prefix, id), state, now, retention_s, extra)
  return refund
end

-- A task's record (TASK_FIELDS by name), or nil when there is none.
local function load_task(tkey)
  local task = hash_fields(tkey, TASK_FIELDS)
  if not task.state then return nil end
  return task
end

-- The head of a queue: id, score (enqueue µs) and record. An entry without a queued record can
-- only come from a bug or a manual edit: it is dropped (record nil), which keeps the queue
-- moving. Returns nil when the queue is empty.
local function queue_head(prefix, queue_key, deadlines_key)
  local entry = redis.call('ZRANGE', queue_key, 0, 0, 'WITHSCORES')
  local head = entry[1]
  if not head then return nil end
  local task = load_task(task_key(prefix, head))
  if task == nil or task.state ~= 'queued' then
    redis.call('ZREM', queue_key, head)
    redis.call('ZREM', deadlines_key, head)
    return head, entry[2], nil
  end
  return head, entry[2], task
end

-- Fencing: a caller with an older epoch than the pool has seen is a deposed leader.
-- A newer epoch is recorded, so the first write of a new leader fences out the old one.
local function check_epoch(state_key, epoch)
  local current = tonumber(redis.call('HGET', state_key, 'epoch') or '0') or 0
  if epoch < current then return false, current end
  if epoch > current then redis.call('HSET', state_key, 'epoch', fmt(epoch)) end
  return true, epoch
end
