-- renew.lua: one heartbeat per gateway and pool extends the lease of all its tasks at once.
--
-- KEYS[1]  clock            HASH  frozen_us (tests only)
-- KEYS[2]  leases           ZSET  gateway -> lease expiry µs
-- KEYS[3]  gateway tasks    SET   the gateway's live task ids
--
-- ARGV[1]  gateway id       ARGV[2] lease TTL (ms)
--
-- A gateway with no live task drops its lease entry instead, so the leases set only holds
-- gateways that hold something.
-- Returns {expiry µs (0 when the lease was dropped), number of live tasks}.

local now = now_us(KEYS[1])
local live = redis.call('SCARD', KEYS[3])
if live == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return {0, 0}
end
local expiry = now + tonumber(ARGV[2]) * 1000
redis.call('ZADD', KEYS[2], fmt(expiry), ARGV[1])
return {fmt(expiry), live}
