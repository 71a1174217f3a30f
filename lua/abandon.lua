-- abandon.lua: a gateway gives up ending one of its tasks (a permanent Redis error, or errors
-- past its retry deadline); stop renewing that task so that its lease runs out and the
-- scheduler's reaper returns its budget, while the gateway's other tasks stay alive.
--
-- KEYS[1]  clock            HASH  frozen_us (tests only)
-- KEYS[2]  leases           ZSET  gateway -> lease expiry µs
-- KEYS[3]  gateway tasks    SET   the live task ids of the gateway (renewed)
-- KEYS[4]  abandoned tasks  SET   the gateway's abandoned task ids (never renewed)
--
-- ARGV[1]  task id
-- ARGV[2]  gateway id
-- ARGV[3]  lease name of the abandoned set: the gateway id + ':abandoned', so that the
--          reaper finds KEYS[4] as that "gateway's" task set
--
-- The task moves to the abandoned set, whose lease entry expires no later than the gateway's
-- current lease (ZADD LT: an earlier abandoned task is never kept longer by a later one): the
-- task ends as 'reaped' within one lease TTL, exactly as if its gateway had died. A task no
-- longer in the gateway's set (it ended, or was reaped) is left alone.
-- Returns {1 if moved else 0, lease expiry µs of the abandoned set (0 when not moved)}.

local now = now_us(KEYS[1])
if redis.call('SMOVE', KEYS[3], KEYS[4], ARGV[1]) == 0 then return {0, 0} end
local expiry = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[2]) or now) or now
redis.call('ZADD', KEYS[2], 'LT', fmt(expiry), ARGV[3])
return {1, fmt(tonumber(redis.call('ZSCORE', KEYS[2], ARGV[3])))}
