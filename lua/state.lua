-- state.lua: the leader publishes a pool's zone and node capacities for the gateways.
--
-- KEYS[1]  state            HASH  epoch, zone, updated_us, and the extra fields given (replaced
--                          whole, so a node that left takes its figures with it)
-- KEYS[2]  clock            HASH  frozen_us (tests only)
-- KEYS[3..5] node_capacity, node_capacity:normal, node_capacity:batch
--                          HASH  node -> tokens that VIP, Normal, Batch may reserve there, each
--                          up to its own tier's ceiling (replaced whole: absent nodes get nothing)
-- KEYS[6]  node_prefill     HASH  node -> limit on node_prefill_released, node:window -> tokens,
--                          node:rate -> tokens/s, node:running -> sequences, node:lane ->
--                          the lane's cap in tasks (lanes only), :at and
--                          :until -> µs, node:vips -> the node's count of VIP placements
--                          when its running sequences were read (replaced whole; optional:
--                          without KEYS[6] ARGV carries no prefill group count either; see
--                          prefill_of() in _room.lua)
--
-- ARGV[1]  caller's fencing epoch
-- ARGV[2]  zone: GREEN | YELLOW | RED
-- ARGV[3]  n = number of nodes, then n groups (node, VIP tokens, Normal tokens, Batch tokens)
-- then     with KEYS[6]: m = number of nodes with a prefill room, the ms after now until which
--          the rooms refill at their rates, then m groups (node, limit in prompt tokens, window
--          in prompt tokens, prefill rate in tokens/s: 0, no refill, the engine's running
--          sequences: -1, unknown, the lane's cap in Normal and Batch tasks alive on it: -2,
--          not a lane, -1, a lane without a cap, the node's count of VIP placements
--          (node_prefill_released node:vips) read before its running sequences were: -1, none)
-- then     field, value pairs stored into the state hash as given (drain_0..2 in tasks/s,
--          red_clear_s in s while RED, usage figures for operators)
--
-- Returns {'ok', epoch, updated_us} or {'fenced', epoch} (nothing written).

local ok, epoch = check_epoch(KEYS[1], tonumber(ARGV[1]))
if not ok then return {'fenced', epoch} end
local now = now_us(KEYS[2])
local n = tonumber(ARGV[3])
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
for i = 0, n - 1 do
  local at = 4 + 4 * i
  for t = 0, 2 do
    redis.call('HSET', KEYS[3 + t], ARGV[at], ARGV[at + 1 + t])
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', fmt(epoch), 'zone', ARGV[2], 'updated_us', fmt(now))
local extra_start = 4 + 4 * n
if KEYS[6] then
  local m = tonumber(ARGV[extra_start])
  local refill_ms = tonumber(ARGV[extra_start + 1]) or 0
  redis.call('DEL', KEYS[6])
  for i = 0, m - 1 do
    local at = extra_start + 2 + 7 * i
    redis.call('HSET', KEYS[6], ARGV[at], ARGV[at + 1], ARGV[at] .. ':window', ARGV[at + 2],
      ARGV[at] .. ':rate', ARGV[at + 3])
    if tonumber(ARGV[at + 4]) >= 0 then
      redis.call('HSET', KEYS[6], ARGV[at] .. ':running', ARGV[at + 4])
      -- The VIP chats placed since the count was read count as running there until the next
      -- publish (prefill_room()): the scraped sequences do not include them.
      if tonumber(ARGV[at + 6]) >= 0 then
        redis.call('HSET', KEYS[6], ARGV[at] .. ':vips', ARGV[at + 6])
      end
    end
    if tonumber(ARGV[at + 5]) >= -1 then
      redis.call('HSET', KEYS[6], ARGV[at] .. ':lane', ARGV[at + 5])
    end
  end
  if m > 0 then
    redis.call('HSET', KEYS[6], ':at', fmt(now), ':until', fmt(now + refill_ms * 1000))
  end
  extra_start = extra_start + 2 + 7 * m
end
-- In chunks: unpack() of them all passed Lua's C stack limit (8,000 values) at a few
-- hundred nodes, and failed after the writes above.
local EXTRA_CHUNK = 1000
for i = extra_start, #ARGV - 1, EXTRA_CHUNK do
  redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + EXTRA_CHUNK - 1, #ARGV)))
end
return {'ok', epoch, fmt(now)}
