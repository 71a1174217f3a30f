-- leader.lua: scheduler leadership as a lease with a fencing epoch.
--
-- KEYS[1]  leader           STRING the holder's id, expiring after the lease TTL
-- KEYS[2]  epoch            STRING raised at every new leadership to max(stored + 1, Redis TIME
--                          in µs): never below the clock, so a Redis that lost the key or only
--                          its last increments (a failover to a replica that had not received
--                          them) cannot hand out an epoch a deposed leader still holds
--
-- ARGV[1]  caller's id      ARGV[2] lease TTL (ms)
-- ARGV[3]  'acquire' (take the lease if free, or renew it if held) or 'resign' (free it now
--          if held, so a standby takes over without waiting for the TTL)
--
-- Only the holder can renew or free the lease; the epoch is raised each time the lease changes
-- hands, so every leadership has its own number, higher than all before it. Why the clock: an
-- INCR alone restarts from what the server still has. After an asynchronous failover that lost
-- the last increment, the next leader would get the number of the leader before it, and the
-- scripts, which refuse only older epochs, would take the writes of both. An epoch at least the
-- server's time in µs is above every epoch handed out before, as long as the clocks of the
-- servers that held the key agree to better than the failover takes (seconds; NTP keeps them
-- within milliseconds).
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
epoch = math.max(epoch + 1, time_us())
redis.call('SET', KEYS[2], fmt(epoch))
redis.call('SET', KEYS[1], me, 'PX', ttl)
return {1, epoch, me, ttl}
