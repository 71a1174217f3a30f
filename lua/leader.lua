-- leader.lua: scheduler leadership as a lease with a fencing epoch.
--
-- KEYS[1]  leader           STRING the holder's id, expiring after the lease TTL
-- KEYS[2]  epoch            STRING counter, raised once per new leadership; when it is missing
--                          (first start, or a Redis that lost its data) it starts from Redis
--                          TIME in µs, so epochs never go backwards and a paused leader from
--                          before the loss cannot fence out the new one
--
-- ARGV[1]  caller's id      ARGV[2] lease TTL (ms)
-- ARGV[3]  'acquire' (take the lease if free, or renew it if held) or 'resign' (free it now
--          if held, so a standby takes over without waiting for the TTL)
--
-- Only the holder can renew or free the lease; the epoch is raised by INCR each time the lease
-- changes hands, so every leadership has its own number, higher than all before it.
-- Returns {1 if the caller leads after the call else 0, epoch, holder id or '', lease left ms}.

local me, ttl, op = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local holder = redis.call('GET', KEYS[1])
local stored = redis.call('GET', KEYS[2])
local epoch = tonumber(stored or '0')
if op == 'resign' then
  if holder == me then redis.call('DEL', KEYS[1]) end
  return {0, epoch, '', 0}
end
if holder == me then
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {1, epoch, me, ttl}
end
if holder then
  return {0, epoch, holder, redis.call('PTTL', KEYS[1])}
end
if not stored then
  local t = redis.call('TIME')
  epoch = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', KEYS[2], string.format('%.0f', epoch))
else
  epoch = redis.call('INCR', KEYS[2])
end
redis.call('SET', KEYS[1], me, 'PX', ttl)
return {1, epoch, me, ttl}
