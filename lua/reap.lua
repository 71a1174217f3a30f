-- reap.lua: return the budget of tasks whose gateway died and expire overdue queued tasks.
--
-- KEYS[1]  clock            HASH  frozen_us (tests only)
-- KEYS[2]  node_reserved    HASH  node -> tokens
-- KEYS[3..5] queue vip, normal, batch   ZSET
-- KEYS[6]  deadlines        ZSET  task id -> deadline µs
-- KEYS[7]  leases           ZSET  gateway -> lease expiry µs
-- KEYS[8]  tenant_queued    HASH
-- KEYS[9]  stats            HASH
--
-- ARGV[1]  key prefix of the pool (task, bucket, gateway, running index, node_guests, quota,
--          tenant, flows, flow and tenant_inflight keys; the ZSET tenant_inflight: tenant -> its
--          in-flight tokens, inflight_index() in _tenant.lua)
-- ARGV[2]  at most this many tasks handled in this call (bounds the script's run time)
-- ARGV[3]  retention (s) of finished records
--
-- A gateway whose lease expired lost its clients: each of its tasks ends as 'reaped', the pool
-- and the tenant get the whole reservation back. A queued task past its deadline ends as
-- 'expired' with a full refund (its gateway, if alive, answers the client on its own): those
-- with a deadline of their own are found in the deadlines index, the others (their tier's
-- timeout) at the head of their queue, where FIFO order puts the earliest deadlines.
-- Returns {tasks reaped, tasks expired, tokens returned to the pool, 1 if work remains else 0}.

local prefix = ARGV[1]
local budget = tonumber(ARGV[2])
local retention_s = tonumber(ARGV[3])
local queues = {KEYS[3], KEYS[4], KEYS[5]}
local now = now_us(KEYS[1])
local reaped, expired, returned = 0, 0, 0

local dead = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', fmt(now), 'LIMIT', 0, budget)
for _, gw in ipairs(dead) do
  local gkey = gateway_key(prefix, gw)
  local ids = redis.call('SPOP', gkey, budget - reaped)
  for _, id in ipairs(ids) do
    local task = load_task(task_key(prefix, id))
    if task and task.state == 'queued' then
      drop_queued(prefix, queues, KEYS[6], KEYS[8], id, task, 'reaped', now, retention_s)
      reaped = reaped + 1
    elseif task and task.state == 'released' then
      drop_released(prefix, KEYS[2], KEYS[9], id, task, 'reaped', -1, now, retention_s)
      returned = returned + tonumber(task.cost)
      reaped = reaped + 1
    end
  end
  if redis.call('SCARD', gkey) == 0 then redis.call('ZREM', KEYS[7], gw) end
  if reaped >= budget then break end
end

if reaped < budget then
  local overdue = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', fmt(now), 'LIMIT', 0, budget - reaped)
  for _, id in ipairs(overdue) do
    local task = load_task(task_key(prefix, id))
    if task and task.state == 'queued' then
      drop_queued(prefix, queues, KEYS[6], KEYS[8], id, task, 'expired', now, retention_s)
      expired = expired + 1
    else
      redis.call('ZREM', KEYS[6], id)
    end
  end
end

for t = 1, TIER_QUEUE_COUNT do
  while reaped + expired < budget do
    local head, _, task = queue_head(prefix, queues[t], KEYS[6])
    if not head then break end
    if task == nil then
      -- a stray entry, dropped by queue_head
    elseif tonumber(task.deadline_us) <= now then
      drop_queued(prefix, queues, KEYS[6], KEYS[8], head, task, 'expired', now, retention_s)
      expired = expired + 1
    else
      break
    end
  end
end

local more = 0
if reaped + expired >= budget then more = 1 end
if reaped > 0 then redis.call('HINCRBY', KEYS[9], 'reaped', reaped) end
if expired > 0 then redis.call('HINCRBY', KEYS[9], 'expired', expired) end
return {reaped, expired, returned, more}
