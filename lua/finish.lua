-- finish.lua: settle or cancel one task, exactly once (idempotent: repeating it is a no-op).
--
-- KEYS[1]  clock            HASH  frozen_us (tests only)
-- KEYS[2]  node_reserved    HASH  node -> tokens
-- KEYS[3..5] queue vip, normal, batch   ZSET
-- KEYS[6]  deadlines        ZSET
-- KEYS[7]  tenant_queued    HASH
-- KEYS[8]  stats            HASH  settled, settled_cost, settled_usage (tokens): counted for
--                                'settled' tasks only (what the scheduler learns from)
-- KEYS[9]  task             HASH
-- KEYS[10] state            HASH  vip_ttft_objective_ms (the leader's; optional, with KEYS[11])
-- KEYS[11] node_vip_ttft    HASH  <node>:n, <node>:over: VIP first tokens seen on each node and
--                                those later than the objective; h<k>: the pool's whose ms lie
--                                in [1.1^k, 1.1^(k+1)) (k from 0 to 120; below 1 ms counts in
--                                h0; one histogram for the pool, which is all the leader uses,
--                                not one per node for it to read every poll): monotonic
--                                counters the leader's release control reads
--                                (scheduler/control.py, scheduler/calm.py)
--
-- ARGV[1]  key prefix of the pool (task, bucket, gateway, running index, node_guests, quota,
--          tenant, flows, flow and tenant_inflight keys; the ZSET tenant_inflight: tenant -> its
--          in-flight tokens, inflight_index() in _tenant.lua)
-- ARGV[2]  task id
-- ARGV[3]  real usage, prompt + generated tokens; -1 = unknown (the client got nothing it can
--          use, so the tenant is refunded in full and nothing is learned from it)
-- ARGV[4]  retention (s) of the finished record
-- ARGV[5]  final state of a released task: 'settled' (response done) or 'cancelled'
--          (client gone, upstream failed)
-- ARGV[6]  ms from the request's dispatch to its node until its first token; -1 or absent:
--          none (only a VIP task's counts, and only while the state hash has an objective)
--
-- A released task: the pool gets its whole reservation back (the sequence left the GPU), the
-- tenant gets cost - usage back (usage above the reservation takes the excess from the
-- bucket, never below zero). A queued task leaves its queue as 'cancelled' with a full refund.
-- A finished or unknown task is left alone.
-- Returns {final state | 'noop', previous state | 'unknown', tokens refunded to the tenant}.

local prefix, id = ARGV[1], ARGV[2]
local usage, retention_s, final = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local task = load_task(KEYS[9])
if task == nil then return {'noop', 'unknown', 0} end
local now = now_us(KEYS[1])
if task.state == 'released' then
  local ttft_ms = tonumber(ARGV[6] or '-1') or -1
  if ttft_ms >= 0 and KEYS[11] and tonumber(task.tier) == 0 then
    local objective = tonumber(redis.call('HGET', KEYS[10], 'vip_ttft_objective_ms') or '')
    if objective then
      redis.call('HINCRBY', KEYS[11], task.node .. ':n', 1)
      if ttft_ms > objective then redis.call('HINCRBY', KEYS[11], task.node .. ':over', 1) end
      -- Log buckets 10% wide: the leader learns the calm distribution from them.
      local bucket = 0
      if ttft_ms >= 1 then bucket = math.min(120, math.floor(math.log(ttft_ms) / math.log(1.1))) end
      redis.call('HINCRBY', KEYS[11], 'h' .. bucket, 1)
    end
  end
  local refund = drop_released(prefix, KEYS[2], KEYS[8], id, task, final, usage, now, retention_s)
  return {final, 'released', refund}
end
if task.state == 'queued' then
  drop_queued(prefix, {KEYS[3], KEYS[4], KEYS[5]}, KEYS[6], KEYS[7], id, task, 'cancelled', now, retention_s)
  return {'cancelled', 'queued', tonumber(task.cost)}
end
return {'noop', task.state, 0}
