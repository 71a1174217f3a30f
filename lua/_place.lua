-- _place.lua: where a released task may run and which node takes it: dedicated nodes and guests,
-- place(), node reservations (the prefill room and lanes it obeys: _room.lua).
-- Prepended to every script, after the files before it in admission/scripts.py LIBRARY (each
-- uses only what those define); not a script of its own. Units as in _lib.lua.

-- Headroom within 1/TIE_SHARE of the best node's counts as a tie (see place()).
local TIE_SHARE = 32
-- VIP goes to the quiet nodes whose engines run at most max(RUNNING_SLACK_MIN, RUNNING_SLACK x
-- the least) more sequences than the least busy of them (least_queued()).
local RUNNING_SLACK, RUNNING_SLACK_MIN = 0.25, 4

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
          quiet = tonumber(st.prefill_quiet or '0') or 0,
          vip_hold_us = (tonumber(st.vip_ttft_objective_ms or '0') or 0) * 1000,
          lane_output = tonumber(st.lane_output or '0') or 0}
end

-- A release call places many tasks against the same node hashes; a placement reads each of
-- them whole (a pool of 256 nodes is thousands of fields), and walks the nodes' prefill rooms.
-- `memo` (new_memo(); nil for a lone placement, as an admit's) keeps, for one call, the hashes
-- as read (`arrays`: HGETALL as returned, `fields`: by name) and the rooms as computed
-- (`rooms`: node -> prefill_room() or false). The call's own writes to those hashes go
-- through memo_incr() and memo_set(), which write to Redis and to the copy alike, and a
-- placement forgets its node's room (memo_placed()), the only one its writes change: every
-- placement of the call then decides on what Redis holds at that moment, as a lone one would.
local function new_memo()
  return {arrays = {}, fields = {}, rooms = {}}
end

local function memo_array(memo, key)
  if memo == nil then return redis.call('HGETALL', key) end
  local flat = memo.arrays[key]
  if flat == nil then
    flat = redis.call('HGETALL', key)
    memo.arrays[key] = flat
  end
  return flat
end

local function memo_fields(memo, key)
  if memo == nil then return all_fields(key) end
  local fields = memo.fields[key]
  if fields == nil then
    fields = all_fields(key)
    memo.fields[key] = fields
  end
  return fields
end

-- HINCRBY, and the same in the copy (a hash read by name only: memo_fields()).
local function memo_incr(memo, key, field, by)
  local after = redis.call('HINCRBY', key, field, by)
  if memo and memo.fields[key] then memo.fields[key][field] = after end
  return after
end

local function memo_set(memo, key, field, value)
  redis.call('HSET', key, field, value)
  if memo and memo.fields[key] then memo.fields[key][field] = value end
end

local function memo_placed(memo, node)
  if memo then memo.rooms[node] = nil end
end

-- A placement of `prompt_tokens` on `node` takes its room; one that only the light rule let
-- through also counts what it took beyond `light_room`, the room place() found there
-- (<node>:light), which the leader takes out of the rooms it publishes next
-- (scheduler.nodestate.take_overdraw). `light_room` nil: not such a placement (place()'s third
-- result). A VIP chat takes no room, but counts as running on the node until the leader's
-- next publish (<node>:vips, prefill_room()), and while quiet nodes are kept
-- (`placement.quiet`) and the objective is published its placement time (<node>:vip, `now`)
-- holds the node's long prefills off for the objective (takes_prompt()).
local function prefill_taken(prefill, placement, tier, node, prompt_tokens, light_room, now,
                             memo)
  memo_placed(memo, node)
  if prefill and tier == 0 then
    memo_incr(memo, prefill.released_key, node .. ':vips', 1)
    if placement.quiet > 0 and placement.vip_hold_us > 0 then
      memo_set(memo, prefill.released_key, node .. ':vip', fmt(now))
    end
  -- (A record without a prompt count, which only an older version could leave, adds none.)
  elseif prefill and prompt_tokens < math.huge then
    if prefill.idle[node] then
      memo_incr(memo, prefill.limits_key, node, -prefill.idle[node])
      prefill.idle[node] = nil
    end
    if light_room and prompt_tokens > light_room then
      memo_incr(memo, prefill.released_key, node .. ':light',
        prompt_tokens - math.max(light_room, 0))
    end
    memo_incr(memo, prefill.released_key, node, prompt_tokens)
  end
end

-- place()'s reasons, counted per node.
local function why_add(why, reason)
  why[reason] = (why[reason] or 0) + 1
end

-- VIP's candidates (rows {node, kv room, reserved, prefill room: prefill_room(), nil when
-- none is published}): the quiet ones, whose prefill room is at least half their window (a
-- short compute queue ahead of the chat's first token; a node without a published room counts
-- as such), if one of them has KV room for it, else the ones with the most prefill room; the
-- KV rules of place() then choose among them. Among the quiet ones with KV room, only those
-- whose engine runs at most RUNNING_SLACK more sequences than the least busy (the leader
-- publishes the scraped count; the VIP chats placed since count too, prefill_room()):
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
  -- A lane whose cap holds (lane_takes()) counts as quiet here: what queues there is a few
  -- short prompts at most, and its short batch is what VIP is steered by; a chat sent to a
  -- node with four times its batch because the lane had a chat or two to prefill waits there
  -- for a long step or two.
  local function for_vip(c) return is_quiet(c[4]) or (c[4] and (c[4].lane or -1) >= 0) end
  local out, top = pick(for_vip)
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
        return for_vip(c) and (running(c) or 0) <= most end)
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

-- A VIP chat's hold keeps a long prefill off its node for the objective (takes_prompt()), so
-- that the chat's first step carries none of the document. The hold only chooses where the
-- document goes, never whether: where it alone keeps the document off every node that could
-- take it (each quiet node has had a VIP chat within the objective, which a steady VIP stream
-- of a few chats a second per node makes always true), the document goes to the node whose
-- chat was placed the longest ago (the likeliest to have had its first step), ties in name
-- order. A hold that could refuse everywhere would hold the document's tier and every tier
-- below it behind it for as long as VIP keeps arriving (lua/release.lua: a head that fits no
-- node holds its tier), with KV and prefill room free.
-- `yields`: place()'s rows {node, placement µs, group, overdraw, the tier's KV room there};
-- `cost`: the task's tokens. Returns the row, or nil when none has the KV room.
local function held_yield(yields, cost)
  local pick = nil
  for _, y in ipairs(yields) do
    if y[5] >= cost and (pick == nil or y[2] < pick[2] or (y[2] == pick[2] and y[1] < pick[1])) then
      pick = y
    end
  end
  return pick
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
-- when no room is published), for prefill_taken(). A VIP chat's hold on long prefills
-- chooses where the task goes, never whether (held_yield()).
--
-- `why` (a table, or nil): when no node takes the task, what stopped it on each node the tier
-- has capacity on, counted by reason (why_held()): 'kv' (the node's capacity for the tier less
-- what is reserved there, less any fair hold-back, is below the task's cost: the tier's
-- ceiling on the node's KV), 'prefill' (the release control's room: window, backlog, running
-- limit), 'quiet' (a long prefill kept off the nodes kept quiet for VIP, or off a node a VIP
-- chat was just placed on), 'lane' (a VIP lane's rules), 'dedicated' (a dedicated node the
-- task may not use). The release script records it for operators (lua/release.lua).
local function place(cap_key, resv_key, gst_key, pc_key, stats_key, placement, tier, cost,
                     prompt_tokens, now, guests_only, prefill, keep, light, memo, why)
  local caps = memo_array(memo, cap_key)
  local owns_dedicated = math.floor(placement.tiers / 2 ^ tier) % 2 == 1
  local may_guest = not owns_dedicated and placement.guest_cap > 0
    and prompt_tokens <= placement.guest_prompt
    and (placement.guest_output == 0 or cost - prompt_tokens <= placement.guest_output)
  local candidates = {{}, {}}
  local best = {}
  local pf_rooms = {}
  -- Each node's prefill room, read once (false: none published).
  local rooms = memo and memo.rooms or {}
  local limits, released = nil, nil
  if prefill then
    limits = memo_fields(memo, prefill.limits_key)
    released = memo_fields(memo, prefill.released_key)
  end
  local function room_of(node)
    if rooms[node] == nil then
      rooms[node] = prefill_room(prefill, node, limits, released) or false
    end
    return rooms[node] or nil
  end
  local reserved_of = memo_fields(memo, resv_key)
  local function reserved_at(node) return tonumber(reserved_of[node] or '0') or 0 end
  -- The tier's KV room on a node: its ceiling there less what is reserved, less any fair
  -- hold-back.
  local function kv_room(node, cap)
    local room = cap - reserved_at(node)
    if keep and keep > 0 and cap > 0 then room = room - math.floor(keep * cap) end
    return room
  end
  -- Nodes only a VIP chat's hold kept a long prefill off ({node, the chat's placement µs,
  -- group, whether only the light rule lets it through, KV room}): see held_yield().
  local yields = nil
  -- Rooms of the nodes with capacity for the tier, when long prefills must leave quiet nodes.
  local computes, need, quiet = nil, 0, 0
  if prefill and tier > 0 and placement.quiet > 0 then
    computes = {}
    local n = 0
    for i = 1, #caps, 2 do
      if (tonumber(caps[i + 1]) or 0) > 0 then
        local compute = room_of(caps[i])
        computes[caps[i]] = compute or false
        n = n + 1
        if is_quiet(compute) then quiet = quiet + 1 end
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
    if why and not allowed then why_add(why, 'dedicated') end
    local compute, overdraw = nil, false
    if allowed and prefill then
      compute = room_of(node)
      if tier > 0 then
        local held = keep ~= nil and keep > 0
        local vip_held = compute ~= nil and compute.vip_at ~= nil
          and now - compute.vip_at < placement.vip_hold_us
        local takes = takes_prompt(compute, computes, quiet, need, node, prompt_tokens, light,
                                   held, vip_held)
        local function lane()
          return lane_takes(compute, gst_key, node, prompt_tokens, cost - prompt_tokens,
                            placement.lane_output)
        end
        allowed = takes and lane()
        if why and not allowed then
          why_add(why, takes and 'lane' or prefill_reason(compute, prompt_tokens, light, held,
                                                          need))
        end
        -- Only what the light rule alone let through is an overdraw (prefill_taken()).
        overdraw = light and allowed
          and not takes_prompt(compute, computes, quiet, need, node, prompt_tokens, false,
                               held, vip_held)
        if vip_held and not takes
            and takes_prompt(compute, computes, quiet, need, node, prompt_tokens, light, held,
                             false) and lane() then
          yields = yields or {}
          table.insert(yields, {node, compute.vip_at, group, light
            and not takes_prompt(compute, computes, quiet, need, node, prompt_tokens, false,
                                 held, false), kv_room(node, tonumber(caps[i + 1]) or 0)})
        end
      end
    end
    if allowed then
      local room = kv_room(node, tonumber(caps[i + 1]) or 0)
      table.insert(candidates[group], {node, room, reserved_at(node), compute})
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
      local guest = group == 1 and not owns_dedicated
      if not guest and tier > 0 and rooms[node] and rooms[node].lane then guest = 'lane' end
      return node, guest, pf_rooms[node]
    end
  end
  local pick = yields and held_yield(yields, cost)
  if pick then
    local node = pick[1]
    local guest = pick[3] == 1 and not owns_dedicated
    if not guest and rooms[node] and rooms[node].lane then guest = 'lane' end
    return node, guest, pick[4] and rooms[node].room or nil
  end
  if why then
    for group = 1, 2 do
      for _ = 1, #candidates[group] do why_add(why, 'kv') end
    end
  end
  return nil, false
end

-- A task released as a guest (`guest`: true on a dedicated node, 'lane' on a lane) holds one of
-- its node's guest slots until it ends, and on a paced dedicated node puts off the next guest
-- by its prompt's share of the rate (from now, or from the time the node was already paced
-- to, whichever is later).
local function guest_joined(gst_key, pc_key, placement, tkey, node, prompt_tokens, now, guest)
  redis.call('HINCRBY', gst_key, node, 1)
  redis.call('HSET', tkey, 'guest', '1')
  if placement.guest_rate > 0 and guest ~= 'lane' then
    local from = math.max(now, tonumber(redis.call('HGET', pc_key, node) or '0') or 0)
    redis.call('HSET', pc_key, node,
      fmt(from + math.floor(prompt_tokens * 1000000 / placement.guest_rate)))
  end
end

local function reserve_node(resv_key, node, cost, memo)
  memo_incr(memo, resv_key, node, cost)
end

local function unreserve_node(resv_key, node, cost)
  local left = redis.call('HINCRBY', resv_key, node, -cost)
  if left <= 0 then redis.call('HDEL', resv_key, node) end
end
