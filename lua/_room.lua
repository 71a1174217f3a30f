-- _room.lua: the release control's prefill room and VIP lanes as placements read them: what
-- a node's room is now, whether it takes a Normal or Batch prompt, and why not.
-- Prepended to every script, after the files before it in admission/scripts.py LIBRARY (each
-- uses only what those define); not a script of its own. Units as in _lib.lua.

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
-- tokens; <node>:rate -> tokens/s; <node>:running -> sequences; <node>:vips -> the node's
-- count of VIP placements when the leader read them, before its scrape; :at, :until -> µs) and
-- node_prefill_released HASH (<node> -> prompt tokens of Normal and Batch work released there so far; <node>:vip ->
-- µs, the last VIP placement there while quiet nodes are kept, see quiet_others(); <node>:vips
-- -> VIP placements there so far). `now`: µs, Redis TIME.
local function prefill_of(limits_key, released_key, now)
  local f = redis.call('HMGET', limits_key, ':at', ':until')
  local at, till = tonumber(f[1]), tonumber(f[2])
  local refill_s = 0
  if at and till then refill_s = math.max(0, math.min(now, till) - at) / 1000000 end
  return {limits_key = limits_key, released_key = released_key, refill_s = refill_s,
          idle = {}}
end

-- {room = tokens left (may be negative), window = tokens, running = the engine's running
-- sequences at the leader's last scrape and the VIP chats placed there since it read their
-- count, before that scrape
-- (nil: not published; the scrape cannot see them, and VIP is steered by the count: without
-- them every chat of a burst between two polls would go to the same node), lane = the node's lane cap
-- (nil: not a lane; -1: a lane without a cap on its count; see lane_takes()), vip_at = µs of
-- the last VIP placement recorded there (nil: none)} of a node, or nil when unlimited.
-- A refill beyond the window is prefill time the node spent idle, which cannot be banked:
-- prefill_taken() lowers the limit by it (`prefill.idle`) when the node takes work, so that
-- the room after the placement is the window less what was placed, at any later time.
-- `limits` and `released`: the two hashes' fields, read once per placement (all_fields() in
-- _lib.lua).
local function prefill_room(prefill, node, limits, released)
  local limit = tonumber(limits[node])
  if limit == nil then return nil end
  local room = limit - (tonumber(released[node] or '0') or 0)
  local window = tonumber(limits[node .. ':window']) or 0
  local refill = math.floor((tonumber(limits[node .. ':rate']) or 0) * prefill.refill_s)
  prefill.idle[node] = nil
  if refill > 0 and room < window then
    if room + refill > window then prefill.idle[node] = room + refill - window end
    room = math.min(window, room + refill)
  end
  local running = tonumber(limits[node .. ':running'])
  local vips_then = tonumber(limits[node .. ':vips'])
  -- Without the snapshot (a leader of a version that publishes none) nothing is added: the
  -- count alone is every VIP chat ever placed there.
  if running and vips_then then
    running = running + math.max(0, (tonumber(released[node .. ':vips']) or 0) - vips_then)
  end
  return {room = room, window = window, running = running,
          lane = tonumber(limits[node .. ':lane']), vip_at = tonumber(released[node .. ':vip'])}
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
-- Nor does a long prefill go to a node where a VIP chat was placed less than the VIP
-- objective ago (`vip_held`: the chat went there because the node was quiet, and may not
-- have reached the engine or its first step yet): the engine packs a waiting prompt's chunk
-- into the same step as the chat's own prefill, and the chat's first token then waits for a
-- step carrying thousands of the document's tokens (on the lab's full-size nodes, 8.5% of
-- VIP chats in a flood of documents did, at 350-370 ms a step).
-- `computes`: node -> its room, or false when none is published; `quiet`: how many of them
-- are quiet, counted once per placement (the rooms do not change during one), since a count
-- per candidate node made a long prompt's placement quadratic in the pool's nodes.
local function quiet_others(computes, quiet, node)
  local own = computes[node]
  if own ~= nil and is_quiet(own or nil) then return quiet - 1 end
  return quiet
end

-- Whether `node` (its room `compute`) takes a Normal or Batch prompt: prefill_fits(), and for
-- a long prefill while `need` quiet nodes are kept, only while that many others stay quiet
-- and no VIP chat placed there is held (`vip_held`), and then also queued behind another long
-- prefill (the node's queue beyond its window less than this prompt): the nodes the documents
-- go to prefill them back to back instead of idling until the leader's next poll sees the
-- last one done, and only Normal and Batch work waits behind them.
local function takes_prompt(compute, computes, quiet, need, node, prompt_tokens, light, held,
                            vip_held)
  local fits, long = prefill_fits(compute, prompt_tokens, light, held)
  if long and need > 0 then
    return not vip_held and (fits or compute.room + prompt_tokens >= 0)
      and quiet_others(computes, quiet, node) >= need
  end
  return fits
end

-- VIP lanes (`<node>:lane` in the node_prefill hash, published for the first
-- [pools.control] lane_nodes usable nodes of the pool by name; scheduler/control.py, "Lanes"):
-- a node where a VIP chat finds a short decode batch and no long prefill however long the
-- flood. VIP is placed there by the usual rules (least_queued() steers it to the quiet node
-- running the fewest sequences, which in a flood is the lane); a Normal or Batch task goes to
-- a lane only with a prompt of at most twice its window (a long document's prefill would hold
-- every VIP chat there for its whole length), with a declared output (`output`: its KV cost
-- less its prompt) of at most `placement.lane_output` when that is set (a long generation
-- would hold the lane's batch for minutes), and while fewer than the lane's cap of such
-- tasks are alive on it (`gst_key`, the guests count: the placement joins it, the task's end
-- leaves it; a cap of -1 counts nothing, the leader has not learned one yet). Exact across
-- gateways: the count moves in the same script as the placement.
local function lane_takes(compute, gst_key, node, prompt_tokens, output, lane_output)
  if compute == nil or compute.lane == nil then return true end
  if prompt_tokens > 2 * compute.window then return false end
  if lane_output > 0 and output > lane_output then return false end
  return compute.lane < 0
    or (tonumber(redis.call('HGET', gst_key, node) or '0') or 0) < compute.lane
end

-- Why takes_prompt() refused a prompt: 'quiet' when the room would have taken it and only the
-- quiet-node rules held it (a long prefill while quiet nodes are kept), else 'prefill'.
local function prefill_reason(compute, prompt_tokens, light, held, need)
  local fits, long = prefill_fits(compute, prompt_tokens, light, held)
  if long and need > 0 and (fits or compute.room + prompt_tokens >= 0) then return 'quiet' end
  return 'prefill'
end
