-- _tenant.lua: what the scripts keep per tenant: tokens in flight (and the pool's index of the
-- tenants with some), the decayed drain rate, the queued count, and fair release within a tier
-- (virtual counters, flows, the light view).
-- Prepended to every script, after the files before it in admission/scripts.py LIBRARY (each
-- uses only what those define); not a script of its own. Units as in _lib.lua.

-- Virtual counter units per token served at weight 1 (admission/keys.py VT_SCALE).
local VT_SCALE = 1000
-- At most this many flows tied at the least counter are compared by the age of their heads.
local TIE_SCAN = 8
-- Time constant of a tenant's drain rate (the tokens released from its queue, decayed), µs.
local DRAIN_TAU_US = 5000000
-- The longest wait a drain rate is turned into (ms); the caller caps its hint lower.
local DRAIN_WAIT_MAX_MS = 1000000000
-- At most this many light tenants, and this many backlogged flows, make up the view a
-- release judges a tenant's share of the in-flight tokens against (fair_view()).
local LIGHT_SCAN = 8

-- The pool's index of tenants with tokens in flight (inflight_key()) follows `after`, a
-- tenant's in-flight tokens just written: the leader's metrics read the tenants with nothing
-- queued from it, where a SCAN of every tenant hash each second would cost too much on a large
-- keyspace. Written as the absolute value the hash holds, not as an increment: a tenant with
-- tokens in flight before the index existed (an upgrade) joins it, with the right figure, at
-- its next change.
local function inflight_index(prefix, tenant, after)
  if after > 0 then
    redis.call('ZADD', inflight_key(prefix), fmt(after), tenant)
  else
    redis.call('ZREM', inflight_key(prefix), tenant)
  end
end

-- A tenant's tokens reserved by its released, unfinished tasks (`inflight_tokens` in its hash).
local function inflight_add(prefix, tenant, cost)
  inflight_index(prefix, tenant,
    redis.call('HINCRBY', tenant_key(prefix, tenant), 'inflight_tokens', cost))
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
  local after = redis.call('HINCRBY', tkey, 'inflight_tokens', -cost)
  if after <= 0 then redis.call('HDEL', tkey, 'inflight_tokens') end
  inflight_index(prefix, tenant, after)
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

-- The counter after the lift a flow gets as it becomes backlogged (written back when raised),
-- and the lift's epoch. Each lift counts (`lifts_<tier>`: the epoch a charge records, lift_epoch()) and leaves the
-- room the counter had above the floor (`liftroom_<tier>`): the refunds of the tasks charged
-- before it may take back no more than that (flow_settle()).
local function flow_lift(prefix, tier, tkey)
  local floor = flow_floor(prefix, tier)
  local own = tenant_vt(tkey, tier)
  local epoch = redis.call('HINCRBY', tkey, 'lifts_' .. tier, 1)
  redis.call('HSET', tkey, 'liftroom_' .. tier, fmt(math.max(0, own - floor)))
  if own < floor then
    own = floor
    redis.call('HSET', tkey, 'vt_' .. tier, fmt(own))
  end
  return own, epoch
end

-- A task queued at `score` (µs) joins its tenant's flow; the tenant's queued tokens grow by its
-- cost; an empty flow becomes backlogged, lifted.
local function flow_join(prefix, tier, tenant, id, score, cost)
  local fkey = flow_key(prefix, tier, tenant)
  local tkey = tenant_key(prefix, tenant)
  redis.call('ZADD', fkey, fmt(score), id)
  redis.call('HINCRBY', tkey, 'queued_tokens', cost)
  if redis.call('ZCARD', fkey) == 1 then
    redis.call('ZADD', flows_key(prefix, tier), fmt((flow_lift(prefix, tier, tkey))), tenant)
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
--
-- A task charged before its tenant's latest lift gets back no more than the room that lift
-- left (and takes it): the lift compared a counter that still held the task's full charge, so
-- more would take the counter below the floor and give the tenant credit for the time it was
-- away, which the lift is there to deny. A task charged since gets back its whole share.
local function flow_settle(prefix, task, usage)
  local charge, cost = tonumber(task.charge), tonumber(task.cost)
  if not charge or not cost or cost <= 0 then return end
  local unused = cost
  if usage >= 0 then unused = cost - usage end
  local back = math.floor(charge * unused / cost)
  local tier = tonumber(task.tier)
  local epoch = tonumber(task.lift_epoch)
  if back > 0 and epoch then
    local tkey = tenant_key(prefix, task.tenant)
    local lift = redis.call('HMGET', tkey, 'lifts_' .. tier, 'liftroom_' .. tier)
    if epoch < (tonumber(lift[1]) or 0) then
      local room = tonumber(lift[2]) or 0
      back = math.min(back, math.max(0, room))
      redis.call('HSET', tkey, 'liftroom_' .. tier, fmt(room - back))
    end
  end
  if back ~= 0 then vt_add(prefix, tier, task.tenant, -back) end
end

-- The lift epoch a charge of `tenant` in `tier` records on its task (flow_settle()).
local function lift_epoch(prefix, tier, tenant)
  return redis.call('HGET', tenant_key(prefix, tenant), 'lifts_' .. tier) or '0'
end

-- The tenants a release call passes over in one tier: `set` of them, and `rows`,
-- the score and name of each one's row in the tier's flows ZSET. A passed-over flow leaves the
-- ZSET for the rest of the tier's turn (pass_over()) and is put back with its counter at the
-- end of it (passed_back()), so next_flow() reads only the flows it may still serve: a call
-- passing over every tenant of a tier (each at its in-flight cap) reads a few rows per tenant,
-- not the whole passed-over prefix again after each one. Nothing else reads the ZSET during
-- the turn but what charges the tenants served (vt_add()), none of them passed over.
-- It also keeps the flows' heads read during the turn (`heads`, tenant -> {id, score}, false
-- for an empty flow): a flow changes only when its head is taken (released, expired or
-- dropped), and head_of() in release.lua forgets the head of the tenant it picks.
local function new_passed()
  return {set = {}, rows = {}, heads = {}}
end

-- The head of `tenant`'s flow of `tier`: {id, score (string)}, or false when it is empty.
local function flow_head(prefix, tier, passed, tenant)
  local head = passed.heads[tenant]
  if head == nil then
    local r = redis.call('ZRANGE', flow_key(prefix, tier, tenant), 0, 0, 'WITHSCORES')
    head = r[1] and {r[1], r[2]} or false
    passed.heads[tenant] = head
  end
  return head
end

local function pass_over(prefix, tier, passed, tenant)
  passed.set[tenant] = true
  local list = flows_key(prefix, tier)
  local score = redis.call('ZSCORE', list, tenant)
  if score then
    table.insert(passed.rows, score)
    table.insert(passed.rows, tenant)
    redis.call('ZREM', list, tenant)
  end
end

-- Lua's unpack() takes a bounded number of values: the rows go back in chunks of pairs.
local PASSED_CHUNK = 1000

local function passed_back(prefix, tier, passed)
  local rows = passed.rows
  for i = 1, #rows, PASSED_CHUNK do
    redis.call('ZADD', flows_key(prefix, tier), unpack(rows, i, math.min(i + PASSED_CHUNK - 1,
                                                                         #rows)))
  end
  passed.rows = {}
end

-- The next flow of `tier` to serve: tenant, head task id and its enqueue score (string), or nil
-- when no flow is left. A listed flow found empty (only a bug or a manual edit leaves one) is
-- dropped from the list.
local function next_flow(prefix, tier, passed)
  local list = flows_key(prefix, tier)
  while true do
    local rows = redis.call('ZRANGE', list, 0, TIE_SCAN - 1, 'WITHSCORES')
    local best, best_id, best_at, best_score, least, stale = nil, nil, nil, nil, nil, false
    for i = 1, #rows, 2 do
      local tenant = rows[i]
      local score = tonumber(rows[i + 1])
      if least == nil then least = score elseif score > least then break end
      local head = flow_head(prefix, tier, passed, tenant)
      if not head then
        redis.call('ZREM', list, tenant)
        passed.heads[tenant] = nil
        stale = true
        break
      end
      local at = tonumber(head[2])
      if best == nil or at < best_at then
        best, best_id, best_at, best_score = tenant, head[1], at, head[2]
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
-- work queued there, not passed over in this call (`passed`), and holding no more than their
-- weighted share of the view's in-flight tokens, the one whose oldest task is oldest: tenant,
-- head id and its score, or nil.
local function light_flow(prefix, tier, view, passed)
  local skip = passed.set
  local best, best_id, best_at, best_score = nil, nil, nil, nil
  for _, tenant in ipairs(view.order) do
    if not skip[tenant] then
      local head = flow_head(prefix, tier, passed, tenant)
      if head then
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
