-- state.lua: the leader publishes a pool's zone and node capacities for the gateways.
--
-- KEYS[1]  state            HASH  epoch, zone, updated_us, and the extra fields given (replaced
--                          whole, so a node that left takes its figures with it)
-- KEYS[2]  clock            HASH  frozen_us (tests only)
-- KEYS[3]  node_capacity    HASH  node -> tokens (replaced whole: absent nodes get nothing)
--
-- ARGV[1]  caller's fencing epoch
-- ARGV[2]  zone: GREEN | YELLOW | RED
-- ARGV[3]  n = number of nodes, then n pairs (node, capacity tokens)
-- then     field, value pairs stored into the state hash as given (drain_0..2 in tasks/s,
--          red_clear_s in s while RED, usage figures for operators)
--
-- Returns {'ok', epoch, updated_us} or {'fenced', epoch} (nothing written).

local ok, epoch = check_epoch(KEYS[1], tonumber(ARGV[1]))
if not ok then return {'fenced', epoch} end
local now = now_us(KEYS[2])
local n = tonumber(ARGV[3])
redis.call('DEL', KEYS[3])
for i = 0, n - 1 do
  redis.call('HSET', KEYS[3], ARGV[4 + 2 * i], ARGV[5 + 2 * i])
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', fmt(epoch), 'zone', ARGV[2], 'updated_us', fmt(now))
local extra_start = 4 + 2 * n
if #ARGV >= extra_start + 1 then
  redis.call('HSET', KEYS[1], unpack(ARGV, extra_start))
end
return {'ok', epoch, fmt(now)}
