-- admit.lua: admit, queue or reject one request, atomically.
--
-- KEYS[1]  state            HASH  zone, updated_us, drain_0..2 (tasks/s), dedicated_nodes,
--                                dedicated_tiers, dedicated_guest_prompt, dedicated_guest_cap,
--                                dedicated_guest_rate, dedicated_guest_output,
--                                dedicated_guests_closed (see place() in _place.lua),
--                                prefill_quiet (quiet nodes kept, count; place()),
--                                vip_ttft_objective_ms (a VIP placement's hold on long
--                                prefills, prefill_taken()), lane_output (tokens, a
--                                lane's bound on declared outputs, lane_takes()),
--                                red_clear_s (s), by the scheduler
-- KEYS[2]  clock            HASH  last_us, frozen_us (tests only)
-- KEYS[3]  node_capacity    HASH  node -> tokens this task's tier may reserve there (the
--                                tier's own hash: node_capacity, node_capacity:normal or
--                                node_capacity:batch)
-- KEYS[4]  node_reserved    HASH  node -> tokens
-- KEYS[5..7] queue vip, normal, batch   ZSET task id -> enqueue µs
-- KEYS[8]  deadlines        ZSET  task id -> deadline µs, only for tasks whose timeout is shorter
--                                than their tier's (the others expire in queue order)
-- KEYS[9]  leases           ZSET  gateway -> lease expiry µs
-- KEYS[10] tenant_queued    HASH  tenant -> queued count
-- KEYS[11] stats            HASH  counters (released_0..2 also take turns among tied nodes,
--                                see place() in _place.lua); normal_credit: Normal tasks of the
--                                YELLOW rate the fast path may still release (set by release.lua)
-- KEYS[12] task             HASH  this task's record (must not exist yet)
-- KEYS[13] bucket           HASH  the tenant's bucket in this pool
-- KEYS[14] gateway tasks    SET   the calling gateway's live tasks
-- KEYS[15] running          ZSET  'node prompt max id' -> released µs (released tasks)
-- KEYS[16] node_guests      HASH  dedicated node or lane -> tasks of other tiers alive on it
-- KEYS[17] node_guest_pace  HASH  dedicated node -> µs (Redis TIME) before which it takes no
--                                guest (paced guests only)
-- KEYS[18] node_prefill     HASH  node -> limit on node_prefill_released (tokens), node:window
--                                -> tokens: the leader's prefill room (optional: without
--                                KEYS[18..19] no room is applied; see prefill_of() in _room.lua)
-- KEYS[19] node_prefill_released  HASH  node -> prompt tokens of Normal and Batch work released
--                                there so far (raised here on a fast-path release), <node>:light
--                                -> what light tenants took beyond the room (prefill_taken()),
--                                <node>:vip -> µs of the last VIP placement (prefill_taken())
--
-- ARGV[1]  task id          ARGV[2]  tenant         ARGV[3] tier (0 VIP, 1 Normal, 2 Batch)
-- ARGV[4]  cost W = prompt + max output tokens (tokens)
-- ARGV[5]  prompt tokens    ARGV[6]  max output tokens (both recorded for the scheduler)
-- ARGV[7]  bucket rate (tokens/s, integer)   ARGV[8] bucket burst (tokens)
-- ARGV[9]  max queued tasks of this tenant   ARGV[10] max queued tasks in this tier
-- ARGV[11] queue timeout (ms): a queued task expires after it
-- ARGV[12] gateway id       ARGV[13] gateway lease TTL (ms)
-- ARGV[14] stale_after_ms: no fast path if the scheduler's state is older (0 = do not check)
-- ARGV[15] the tier's own queue timeout (ms); a task queued with exactly that timeout gets no
--          deadlines entry (optional: absent or 0 indexes every queued task)
-- ARGV[16] key prefix of the pool: the tenant's hash, flows, flow, vtime, light, quota and
--          tenant_inflight keys are built from it ("Fair release" in _tenant.lua; the ZSET
--          tenant_inflight, tenant -> its in-flight tokens, lists the tenants with some:
--          inflight_index() there)
-- ARGV[17] '1': the pool releases in fair order (the fast path then follows it, below);
--          '2': fair order, and releases hold room back for light tenants (fairness
--          headroom above 0: a light tenant's fast path may then overdraw the prefill room,
--          prefill_fits() in _room.lua); '0': FIFO
-- ARGV[18] the tenant's weight (a positive number), stored in its hash for the release
-- ARGV[19] the tenant's cap on queued tokens in this pool (0: none)
-- ARGV[20] the tenant's cap on in-flight tokens (reserved by its released, unfinished tasks) in
--          this pool (0: none); stored in its hash for the release, which passes over a tenant
--          at its cap; the fast path needs room under it too
-- ARGV[21] the key's daily allowance (tokens per UTC day; 0: none)
-- ARGV[22] the key's monthly allowance (tokens per UTC month; 0: none)
-- ARGV[23] n = enclosing quota levels (the tenant's team, its parent, ...: innermost first),
--          then n groups (name, rate tokens/s, burst tokens, daily tokens, monthly tokens):
--          each level's bucket is quota:<name> ("Quota levels" in _quota.lua); all levels pay
--          or none does
--
-- Fast path: FIFO, when nothing is queued at this tier or above; fair, when nothing is queued
-- above, the tenant has nothing queued in this tier, and its counter is no higher than the
-- least of the tier's backlogged flows (it would be served next: ties go to the arrival) or,
-- in a pool holding room back for light tenants, it holds no more than its weighted share of
-- the in-flight tokens (under_share() in _tenant.lua). A
-- fast path in a tier with backlogged flows is charged to the tenant's counter as a release
-- from the queue is (lifted first); one in an idle tier is not (no one to be fair to). A
-- request accepted (released or queued) with nothing of its tenant's queued in a tier that
-- has backlogged flows marks the tenant light in the tier (light:<tier>: for a while, releases
-- of heavier tenants leave it room, fair_keep() in _tenant.lua), so that its next requests find
-- room on the fast path even when this one had to queue for it.
--
-- Returns {outcome, detail, retry_after_ms, depth, zone, ...}:
--   {'released', node, 0, 0, zone}            fast path: budget debited, node chosen
--   {'queued', '', 0, position, zone}         position counts tasks ahead at this tier or above, itself included
--   {'rejected', reason, retry_after_ms, depth, zone}
--        reason: exceeds_burst (retry_after_ms -1: never fits), quota (ms until the binding
--                level can pay: its refill time, or the start of its next day or month;
--                -1: a bucket that never refills and whose live tasks hold too little to
--                make up the difference; 0: one that never refills but could pay once its live
--                tasks give back their unused tokens, kind 'held'), tenant_queued_tokens (the
--                tenant's queued tokens and this request's are above its cap: ms until the
--                excess drains from its queue at its own drain rate, drain_wait_ms() in
--                _tenant.lua; -1 unknown)
--   {'rejected', 'tenant_queued_tokens', retry_after_ms, depth, zone, queued}   queued: the
--        tokens of the tenant's requests queued in the pool now (without this one)
--   {'rejected', 'tenant_queue_full', retry_after_ms, depth, zone, queued}   the tenant holds
--        its cap of queued requests in the pool (queued: how many it holds); retry_after_ms:
--        ms until its own queue drains the tokens of the requests over the cap, and one more
--        (their average cost each), at its own drain rate, as for tenant_queued_tokens (-1:
--        unknown)
--   {'rejected', 'quota', retry_after_ms, depth, zone, scope, kind}   scope: 'key' or
--        'team:<name>', the binding level; kind: 'bucket', 'daily', 'monthly' or 'held'
--   {'rejected', reason, 0, depth, zone, drain, red_clear_s, state_age_ms}
--        reason: zone_red, no_node (the pool is RED because none of its nodes is usable:
--        the leader published pool_usage ''), queue_full; the caller
--        computes the hint from
--        these (admission/hints.py): drain = tasks/s leaving the queues at this tier or above
--        ('' when no leader measured it), red_clear_s = the leader's estimate of the seconds
--        until the pool leaves RED ('' when none), state_age_ms = now - updated_us (ms; -1
--        when no state was published)
--   {'duplicate', state, 0, 0, zone}          the task id exists: nothing changed (idempotent retry)
-- Rejections charge nothing.

local id, tenant = ARGV[1], ARGV[2]
local tier = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local rate, burst = tonumber(ARGV[7]), tonumber(ARGV[8])
local tenant_cap, tier_cap = tonumber(ARGV[9]), tonumber(ARGV[10])
local timeout_ms = tonumber(ARGV[11])
local gateway, lease_ms = ARGV[12], tonumber(ARGV[13])
local stale_ms = tonumber(ARGV[14])
local tier_timeout_ms = tonumber(ARGV[15] or '0') or 0
local prefix, hold, weight = ARGV[16], ARGV[17] == '2', ARGV[18]
local fair = hold or ARGV[17] == '1'
local queued_cap, inflight_cap = tonumber(ARGV[19] or '0') or 0, tonumber(ARGV[20] or '0') or 0
local queues = {KEYS[5], KEYS[6], KEYS[7]}
local tkey = tenant_key(prefix, tenant)

local now = now_us(KEYS[2])
local st = hash_fields(KEYS[1], ADMIT_STATE_FIELDS)
local zone = st.zone or 'GREEN'

local existing = redis.call('HGET', KEYS[12], 'state')
if existing then return {'duplicate', existing, 0, 0, zone} end

-- Tasks ahead of this one (everything queued at its tier or above), and the rest of what a
-- capacity rejection's hint is computed from (header).
local ahead, drain, state_age_ms, own_tier = hint_facts(queues, tier, st, now)

local function capacity_rejected(reason)
  return {'rejected', reason, 0, ahead, zone, drain, st.red_clear_s or '', state_age_ms}
end

if cost > burst then return {'rejected', 'exceeds_burst', -1, ahead, zone} end
if zone == 'RED' and tier > 0 then
  return capacity_rejected(st.pool_usage == '' and 'no_node' or 'zone_red')
end

-- The quota levels: the key's own bucket and allowances, then every enclosing level's
-- (innermost first). The binding level is the one that can pay last (never, first of all).
local levels = {{key = KEYS[13], scope = 'key', rate = rate, burst = burst,
  daily = tonumber(ARGV[21] or '0') or 0, monthly = tonumber(ARGV[22] or '0') or 0}}
local names = {}
for i = 0, (tonumber(ARGV[23] or '0') or 0) - 1 do
  local at = 24 + 5 * i
  table.insert(names, ARGV[at])
  table.insert(levels, {key = quota_key(prefix, ARGV[at]), scope = 'team:' .. ARGV[at],
    rate = tonumber(ARGV[at + 1]), burst = tonumber(ARGV[at + 2]),
    daily = tonumber(ARGV[at + 3]), monthly = tonumber(ARGV[at + 4])})
end
local allowances = false
local short, short_wait, short_kind = nil, nil, nil
for _, lvl in ipairs(levels) do
  if lvl.daily > 0 or lvl.monthly > 0 then allowances = true end
  local wait, kind = level_short(lvl, now, cost)
  if wait ~= nil and (short == nil or (short_wait >= 0 and (wait < 0 or wait > short_wait))) then
    short, short_wait, short_kind = lvl, wait, kind
  end
end
if short then return {'rejected', 'quota', short_wait, ahead, zone, short.scope, short_kind} end

-- Fast path: nothing waits ahead of this request in its tier's order (header), the zone
-- releases this tier freely (GREEN releases every tier, YELLOW and RED still release VIP;
-- YELLOW releases a light tenant's Normal request against the rate's credit, below), the
-- scheduler's view is fresh, and a node the tier may use has room for the whole reservation.
local fresh = stale_ms == 0 or (st.updated_us and now - tonumber(st.updated_us) <= stale_ms * 1000)
local node, guest, placement, prefill, pf_room = nil, false, nil, nil, nil
local first, busy = ahead == 0, false
-- (The flows mirror the tier's queue: with nothing queued in the tier there is no flow to read.)
if fair then
  first = ahead == own_tier
  if own_tier > 0 and redis.call('EXISTS', flow_key(prefix, tier, tenant)) == 0 then
    local least
    least, busy = flow_floor(prefix, tier)
    if first and busy then
      first = tenant_vt(tkey, tier) <= least or (hold and under_share(prefix, tier, tenant, weight))
    end
  elseif own_tier > 0 then
    first = false
  end
end
-- In YELLOW, Normal leaves the queue at the leader's rate; a light tenant's request (first in
-- the fair order beside others' backlog) takes one of the tasks of that rate the last release
-- left it (normal_credit), at once rather than at the leader's next release.
local credit = false
if tier == 1 and zone == 'YELLOW' and hold and busy and first then
  credit = (tonumber(redis.call('HGET', KEYS[11], 'normal_credit') or '0') or 0) >= 1
end
if first and fresh and (zone == 'GREEN' or tier == 0 or credit)
    and inflight_fits(tkey, cost, inflight_cap) then
  placement = placement_of(st)
  if KEYS[19] then prefill = prefill_of(KEYS[18], KEYS[19], now) end
  node, guest, pf_room = place(KEYS[3], KEYS[4], KEYS[16], KEYS[17], KEYS[11], placement, tier,
    cost, tonumber(ARGV[5]), now, false, prefill, nil, hold and busy)
end

if node == nil then
  if redis.call('ZCARD', queues[tier + 1]) >= tier_cap then
    return capacity_rejected('queue_full')
  end
  local own = tonumber(redis.call('HGET', KEYS[10], tenant) or '0') or 0
  if own >= tenant_cap then
    -- The key's own cap: a place opens as its own queue drains, so the wait is that of the
    -- tokens of as many of its requests as it holds over the cap, plus one, at its own drain
    -- rate (its queued requests' average taken for theirs); -1 when none is queued.
    local wait = -1
    if own > 0 then
      local tokens = tonumber(redis.call('HGET', tkey, 'queued_tokens') or '0') or 0
      wait = drain_wait_ms(tkey, now, math.ceil(tokens * (own - tenant_cap + 1) / own))
    end
    return {'rejected', 'tenant_queue_full', wait, ahead, zone, own}
  end
  if queued_cap > 0 then
    local queued = tonumber(redis.call('HGET', tkey, 'queued_tokens') or '0') or 0
    local excess = queued + cost - queued_cap
    if excess > 0 then
      return {'rejected', 'tenant_queued_tokens', drain_wait_ms(tkey, now, excess), ahead, zone,
        queued}
    end
  end
end

-- Kept per level ('-': no allowances), in the order task_credit() reads them back: after the
-- clock stepped back, one level may count the task in the later day another key's request
-- began there while the key's own still counts in the earlier one.
local days, months = {}, {}
for _, lvl in ipairs(levels) do
  local day, month = level_debit(lvl, now, cost)
  table.insert(days, day and fmt(day) or '-')
  table.insert(months, month and fmt(month) or '-')
end
redis.call('ZADD', KEYS[9], fmt(now + lease_ms * 1000), gateway)
redis.call('SADD', KEYS[14], id)
-- No enqueue time in the record: while queued it is the task's score in its queue, and the
-- release copies it in as queued_us (one field less per queued task, bench.perf.memory).
redis.call('HSET', KEYS[12], 'state', 'queued', 'tenant', tenant, 'tier', tier, 'cost', cost,
  'prompt_tokens', ARGV[5], 'max_tokens', ARGV[6], 'gateway', gateway)
if #names > 0 then redis.call('HSET', KEYS[12], 'levels', table.concat(names, ' ')) end
if allowances then
  redis.call('HSET', KEYS[12], 'quota_day', table.concat(days, ' '), 'quota_month',
    table.concat(months, ' '))
end

if node then
  reserve_node(KEYS[4], node, cost)
  inflight_add(prefix, tenant, cost)
  redis.call('HSET', KEYS[12], 'state', 'released', 'node', node, 'released_us', fmt(now))
  if busy then
    redis.call('HSET', tkey, 'weight', weight)
    local _, epoch = flow_lift(prefix, tier, tkey)
    redis.call('HSET', KEYS[12], 'charge', fmt(flow_charge(prefix, tier, tenant, cost)),
      'lift_epoch', epoch)
    redis.call('ZADD', light_key(prefix, tier), fmt(now), tenant)
  end
  if guest then
    guest_joined(KEYS[16], KEYS[17], placement, KEYS[12], node, tonumber(ARGV[5]), now,
      guest)
  end
  prefill_taken(prefill, placement, tier, node, tonumber(ARGV[5]), pf_room, now)
  redis.call('ZADD', KEYS[15], fmt(now), running_member(node, ARGV[5], ARGV[6], id))
  redis.call('HINCRBY', KEYS[11], 'released_' .. tier, 1)
  redis.call('HINCRBY', KEYS[11], 'fast_path', 1)
  if credit then
    redis.call('HINCRBY', KEYS[11], 'normal_credit', -1)
    redis.call('HINCRBY', KEYS[11], 'credit_used', 1)
  end
  return {'released', node, 0, 0, zone}
end

local deadline = now + timeout_ms * 1000
local score = queue_clock(KEYS[2], now)
redis.call('HSET', KEYS[12], 'deadline_us', fmt(deadline))
redis.call('ZADD', queues[tier + 1], fmt(score), id)
redis.call('HSET', tkey, 'weight', weight, 'inflight_cap', fmt(inflight_cap))
flow_join(prefix, tier, tenant, id, score, cost)
if busy then redis.call('ZADD', light_key(prefix, tier), fmt(now), tenant) end
-- Within a tier, tasks with the tier's own timeout expire in the order they queued, so the
-- reaper finds them at the head of the queue; only a shorter (client-set) deadline needs the
-- index. Saves a sorted-set entry per queued task (bench.perf.memory).
if tier_timeout_ms <= 0 or timeout_ms < tier_timeout_ms then
  redis.call('ZADD', KEYS[8], fmt(deadline), id)
end
redis.call('HINCRBY', KEYS[10], tenant, 1)
return {'queued', '', 0, ahead + 1, zone}
