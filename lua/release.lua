-- release.lua: the leader pops queued tasks in tier order and assigns them nodes.
--
-- KEYS[1]  state            HASH  epoch (fencing), dedicated_nodes, dedicated_tiers,
--                                dedicated_guest_prompt, dedicated_guest_cap,
--                                dedicated_guest_rate, dedicated_guest_output,
--                                dedicated_guests_closed, prefill_quiet (where each
--                                task may run, see place() in _place.lua),
--                                vip_ttft_objective_ms (prefill_taken() in _place.lua),
--                                lane_output (tokens, lane_takes() in _room.lua)
-- KEYS[2]  clock            HASH  frozen_us (tests only)
-- KEYS[3]  node_capacity    HASH  node -> tokens VIP may reserve there
-- KEYS[4]  node_reserved    HASH  node -> tokens
-- KEYS[5..7] queue vip, normal, batch   ZSET task id -> enqueue µs
-- KEYS[8]  deadlines        ZSET  task id -> deadline µs
-- KEYS[9]  tenant_queued    HASH  tenant -> queued count
-- KEYS[10] stats            HASH  counters (released_0..2 also take turns among tied nodes,
--                                see place() in _place.lua)
-- KEYS[11] node_capacity:normal  HASH  node -> tokens Normal may reserve there
-- KEYS[12] node_capacity:batch   HASH  node -> tokens Batch may reserve there
-- KEYS[13] node_prefill     HASH  node -> limit on node_prefill_released (tokens), node:window
--                                -> tokens: the prefill room of Normal and Batch work (optional:
--                                without KEYS[13..14] no room applies; prefill_of() in _room.lua)
-- KEYS[14] node_prefill_released  HASH  node -> prompt tokens of Normal and Batch work released
--                                there so far (raised here by each such release), <node>:light
--                                -> what light tenants took beyond the room (prefill_taken()),
--                                <node>:vip -> µs of the last VIP placement (prefill_taken())
-- KEYS[15] held_by          HASH  with ARGV[14] '1': why each tier's queue waits, as of this
--                                call, for operators (kvgate-inspect, redis-cli, the leader's
--                                metrics):
--                                <tier> -> the reason (below), <tier>:us -> µs it was recorded,
--                                and for a head that fits no node, <tier>:task, <tier>:cost and
--                                <tier>:prompt (its tokens). A tier whose queue this call
--                                emptied, or that did not wait, has no fields. Reasons: the
--                                nodes that refused the head, counted per reason as
--                                'kv=2,prefill=1' (place()'s `why` in _place.lua: kv, prefill,
--                                quiet, lane, dedicated); 'tenant' (the head's tenant is at its
--                                in-flight cap, or every backlogged tenant was passed over);
--                                'no_node' (no node has capacity published for the tier);
--                                'zone' (the zone's release policy: this call's count for the
--                                tier, which is 0 in RED and for Batch in YELLOW, was reached);
--                                'behind <tier>' (a higher tier's head waits, and no task
--                                overtakes it)
--
-- ARGV[1]  key prefix of the pool (for task, bucket, quota, gateway, running, node_guests,
--          node_guest_pace, tenant, flows, flow, vtime, light and tenant_inflight keys: the
--          running index ZSET 'node prompt max id' -> released µs gets each released task, the
--          HASH node_guests counts the guests alive on each dedicated node or lane, the HASH
--          node_guest_pace holds when a paced one takes its next, the ZSET tenant_inflight maps
--          each tenant with tokens in flight to them (inflight_index() in _tenant.lua); the fair
--          keys: "Fair release" in _tenant.lua)
-- ARGV[2]  caller's fencing epoch
-- ARGV[3..5] at most this many releases of VIP, Normal, Batch in this call (the zone policy)
-- ARGV[6]  retention (s) of finished task records
-- ARGV[7]  tiers (bit 2^tier: 1 VIP, 2 Normal, 4 Batch) that this call may release only as
--          guests of dedicated nodes (0 or absent: none); see place()
-- ARGV[8]  '1': fair order within each tier (next_flow() in _tenant.lua); '0' or absent: FIFO
-- ARGV[9]  fair order only: the fraction of each node's capacity a release of a tenant above
--          its share leaves free while lighter tenants are active (fair_keep() in _tenant.lua;
--          0 or absent: none)
-- ARGV[10] fair order only: how long (ms) a tenant counts as light after a request of its was
--          admitted with none of its own queued beside others' backlog (the light:<tier>
--          ZSET, pruned here)
-- ARGV[11] optional: the Normal credit of the YELLOW rate to leave for light tenants' fast
--          path (stats normal_credit, taken by admit.lua; the leader takes what they took out
--          of its rate's next refills), less what they took of the last credit, ARGV[12] (the
--          credit the leader's last call left): the credit and what is owed for it stay within
--          ARGV[11]. Absent or '': the credit is left as it is
-- ARGV[13] optional: the Redis time (µs) this call may run before it stops after its next
--          release (0, '' or absent: no bound). Redis runs one script at a time, and a pool of
--          hundreds of nodes spends about a millisecond on each task's placement, so a call
--          releasing thousands would hold every gateway's admits for seconds. Measured with
--          Redis TIME, not the pool's clock (which tests may freeze). Passing over tenants at
--          their cap is not release: a call never stops during a run of them, or a tenant
--          queued behind many would never be reached
-- ARGV[14] optional: '1' records why each tier waits in KEYS[15] (the tick's main release
--          only: a call limited to one tier would report the others as held by the zone)
--
-- Order: tiers strictly by priority; within a tier FIFO, or with ARGV[8] the head of the
-- backlogged flow with the least virtual counter (weighted fair across tenants, FIFO within a
-- tenant). The next task in that order is the tier's head: when it does not fit on any node
-- it may use, nothing of that tier or below is released in this call (no tier overtakes a
-- higher one and no task overtakes one ahead of it in its tier's order). A head whose tenant
-- is at its cap on in-flight tokens (inflight_cap in its hash) is passed over for the rest of
-- the call in fair order (the tenant's flow is skipped: its cap is its own); in FIFO order it
-- holds its tier like a head that does not fit. In fair order, a head whose tenant must leave
-- room for lighter tenants (ARGV[9]) and finds none left is passed over the same way, and
-- with ARGV[9] above 0 a light tenant with work queued that holds no more than its weighted
-- share of the in-flight tokens is served before the counters' order (light_flow() in
-- _tenant.lua). A tier that only
-- reached its own count limit lets the next tier go on (the scheduler's YELLOW rate and Batch
-- trickle). Queued tasks found past their deadline at the head are expired on the way (tenant
-- refunded). Either order charges each released task to its tenant's counter (flow_charge()),
-- so the order can be switched without losing the tenants' service history.
--
-- Returns {'ok' or 'more', epoch, credit_before, credit_after, task, gateway, node, tier, cost,
-- ...} ('more': the call stopped on its time bound, ARGV[13], or on its bound on the heads it
-- looks at, with work perhaps left that a further call may release):
-- the Normal credit this call found and left (ARGV[11]; both 0 without it), then one 5-tuple
-- per task released
-- or expired (node '' = expired: its gateway must answer the client), or {'fenced', epoch} when
-- the caller's epoch is older than the pool's, in which case nothing changed. cost: the tokens
-- the release reserved (prompt + max output; 0 for an expired task), so the leader can count
-- what each tier got (its Batch share) without reading the task records back.

local prefix = ARGV[1]
local ok, epoch = check_epoch(KEYS[1], tonumber(ARGV[2]))
if not ok then return {'fenced', epoch} end
local limits = {tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
local retention_s = tonumber(ARGV[6])
local guests_only_tiers = tonumber(ARGV[7] or '0') or 0
local fair = ARGV[8] == '1'
local headroom = tonumber(ARGV[9] or '0') or 0
local window_us = (tonumber(ARGV[10] or '0') or 0) * 1000
local queues = {KEYS[5], KEYS[6], KEYS[7]}
local now = now_us(KEYS[2])
local placement = placement_of(hash_fields(KEYS[1], PLACEMENT_FIELDS))
local capacities = {KEYS[3], KEYS[11], KEYS[12]}
local gst_key, pc_key = guests_key(prefix), pace_key(prefix)
local prefill = nil
if KEYS[14] then prefill = prefill_of(KEYS[13], KEYS[14], now) end
-- The node hashes as this call reads and writes them (new_memo() in _place.lua).
local memo = new_memo()
local out = {'ok', epoch, 0, 0}
-- Bounds the work of one call even if a queue holds many expired tasks.
local budget = 2000
local call_us = tonumber(ARGV[13] or '0') or 0
local started_us = 0
if call_us > 0 then started_us = time_us() end
local stopped = false
local held_key = nil
if ARGV[14] == '1' then held_key = KEYS[15] end

-- The held_by hash's fields for tier `t` (KEYS[15]): `reason`, and the head that fits no node
-- (nil: a reason that is not about one task), or none at all (`reason` nil).
local function held(t, reason, head, task)
  if not held_key then return end
  local label = TIER_LABELS[t + 1]
  if reason == nil then
    redis.call('HDEL', held_key, label, label .. ':us', label .. ':task', label .. ':cost',
      label .. ':prompt')
    return
  end
  redis.call('HSET', held_key, label, reason, label .. ':us', fmt(now))
  if head then
    redis.call('HSET', held_key, label .. ':task', head, label .. ':cost', task.cost,
      label .. ':prompt', task.prompt_tokens or '')
  else
    redis.call('HDEL', held_key, label .. ':task', label .. ':cost', label .. ':prompt')
  end
end

-- place()'s `why` as 'kv=2,prefill=1' (reasons in name order).
local function reasons(why)
  local names = {}
  for name in pairs(why) do table.insert(names, name) end
  table.sort(names)
  for i, name in ipairs(names) do names[i] = name .. '=' .. why[name] end
  if #names == 0 then return 'no_node' end
  return table.concat(names, ',')
end

local function queued(t) return redis.call('ZCARD', queues[t + 1]) > 0 end

-- The head of tier `t` in its release order, passing over the tenants in `passed`
-- (new_passed() in _tenant.lua): id, enqueue score, record (nil record: a stray entry, already
-- dropped) and whether it is a light tenant's (light_flow(): it may overdraw the prefill room,
-- as its fast path may), or nil when nothing is left to release. Fair: the head of the next
-- flow; a tier with no backlogged flow at all but a queue (tasks queued by a version without
-- flows) falls back to FIFO.
local function head_of(t, passed, view)
  if fair then
    local tenant, id, score, light = nil, nil, nil, false
    if view and view.nlight > 0 then tenant, id, score = light_flow(prefix, t, view, passed) end
    if tenant then light = true else tenant, id, score = next_flow(prefix, t, passed) end
    if not tenant and next(passed.set) ~= nil then return nil end
    if tenant then
      passed.heads[tenant] = nil
      local task = load_task(task_key(prefix, id))
      if task == nil or task.state ~= 'queued' then
        local fkey = flow_key(prefix, t, tenant)
        redis.call('ZREM', fkey, id)
        if redis.call('EXISTS', fkey) == 0 then redis.call('ZREM', flows_key(prefix, t), tenant) end
        redis.call('ZREM', queues[t + 1], id)
        redis.call('ZREM', KEYS[8], id)
        return id, score, nil
      end
      return id, score, task, light
    end
  end
  return queue_head(prefix, queues[t + 1], KEYS[8])
end

for t = 0, TIER_QUEUE_COUNT - 1 do
  local released = 0
  local blocked = false
  local passed = new_passed()
  local view = nil
  if fair and headroom > 0 then
    view = fair_view(prefix, t, now, window_us)
  elseif fair then
    -- Admits mark light tenants whatever the headroom: without a view the marks still expire.
    redis.call('ZREMRANGEBYSCORE', light_key(prefix, t), '-inf', '(' .. fmt(now - window_us))
  end
  while released < limits[t + 1] and budget > 0 do
    budget = budget - 1
    local head, queued_us, task, light = head_of(t, passed, view)
    if not head then break end
    if task == nil then
      -- a stray entry, dropped by queue_head
    elseif tonumber(task.deadline_us) <= now then
      drop_queued(prefix, queues, KEYS[8], KEYS[9], head, task, 'expired', now, retention_s)
      redis.call('HINCRBY', KEYS[10], 'expired', 1)
      table.insert(out, head); table.insert(out, task.gateway)
      table.insert(out, ''); table.insert(out, t); table.insert(out, 0)
    else
      local cost = tonumber(task.cost)
      local prompt_tokens = tonumber(task.prompt_tokens) or math.huge
      local node, guest, pf_room = nil, false, nil
      local capped = not inflight_fits(tenant_key(prefix, task.tenant), cost, nil)
      local keep = 0
      local why = {}
      local function place_head(hold, reasons_of)
        return place(capacities[t + 1], KEYS[4], gst_key, pc_key, KEYS[10], placement, t, cost,
          prompt_tokens, now, math.floor(guests_only_tiers / 2 ^ t) % 2 == 1, prefill, hold,
          light, memo, reasons_of)
      end
      if not capped then
        if view then keep = fair_keep(prefix, view, task.tenant, headroom) end
        node, guest, pf_room = place_head(keep, why)
      end
      if node == nil and keep > 0 then
        -- Passed over only if the hold-back is what keeps it out: a head that fits nowhere
        -- without it waits for room, and holds its tier, as every head does.
        local free_why = {}
        if place_head(0, free_why) == nil then keep, why = 0, free_why end
      end
      if fair and (capped or (node == nil and keep > 0)) then
        pass_over(prefix, t, passed, task.tenant)
      elseif node == nil then
        blocked = true
        if capped then held(t, 'tenant') else held(t, reasons(why), head, task) end
        break
      else
        redis.call('ZREM', queues[t + 1], head)
        redis.call('ZREM', KEYS[8], head)
        tenant_dequeued(KEYS[9], task.tenant)
        flow_leave(prefix, t, task.tenant, head, cost)
        local charge = flow_charge(prefix, t, task.tenant, cost)
        inflight_add(prefix, task.tenant, cost)
        if view then fair_served(view, task.tenant, cost) end
        drain_add(tenant_key(prefix, task.tenant), now, cost)
        reserve_node(KEYS[4], node, cost, memo)
        redis.call('HSET', task_key(prefix, head), 'state', 'released', 'node', node,
          'queued_us', queued_us, 'released_us', fmt(now), 'charge', fmt(charge),
          'lift_epoch', lift_epoch(prefix, t, task.tenant))
        redis.call('HDEL', task_key(prefix, head), 'deadline_us')
        if guest then
          guest_joined(gst_key, pc_key, placement, task_key(prefix, head), node, prompt_tokens,
            now, guest)
        end
        prefill_taken(prefill, placement, t, node, prompt_tokens, pf_room, now, memo)
        redis.call('ZADD', running_key(prefix), fmt(now),
          running_member(node, task.prompt_tokens, task.max_tokens, head))
        redis.call('HINCRBY', KEYS[10], 'released_' .. t, 1)
        released = released + 1
        table.insert(out, head); table.insert(out, task.gateway)
        table.insert(out, node); table.insert(out, t); table.insert(out, cost)
        if call_us > 0 and time_us() - started_us >= call_us then
          stopped = true
          break
        end
      end
    end
  end
  local passed_any = next(passed.set) ~= nil
  passed_back(prefix, t, passed)
  if budget <= 0 then stopped = true end
  -- A call stopped on its bounds says nothing of what waits: the next call will.
  if not blocked and not stopped then
    if released >= limits[t + 1] and queued(t) then
      held(t, 'zone')
    elseif passed_any and queued(t) then
      held(t, 'tenant')
    else
      held(t, nil)
    end
  end
  if blocked then
    for u = t + 1, TIER_QUEUE_COUNT - 1 do
      held(u, queued(u) and ('behind ' .. TIER_LABELS[t + 1]) or nil)
    end
  end
  if blocked or stopped then break end
end
if stopped then out[1] = 'more' end
if ARGV[11] and ARGV[11] ~= '' then
  local before = math.max(0, tonumber(redis.call('HGET', KEYS[10], 'normal_credit') or '0') or 0)
  local taken = math.max(0, (tonumber(ARGV[12] or '0') or 0) - before)
  out[3], out[4] = before, math.max(0, math.floor(tonumber(ARGV[11]) or 0) - taken)
  redis.call('HSET', KEYS[10], 'normal_credit', out[4])
end
return out
