-- _task.lua: the end of a task (finished, dropped from its queue or from its node), its record,
-- a queue's head, and the fencing epoch.
-- Prepended to every script, after the files before it in admission/scripts.py LIBRARY (each
-- uses only what those define); not a script of its own. Units as in _lib.lua.

-- Move a task to a terminal state and let its record expire after `retention_s`, so a late
-- settle or cancel still finds it and does nothing.
local function task_finish(tkey, state, now, retention_s, extra)
  redis.call('HSET', tkey, 'state', state, 'finished_us', fmt(now))
  if extra then redis.call('HSET', tkey, unpack(extra)) end
  redis.call('EXPIRE', tkey, retention_s)
end

-- A queued task leaves its queue without being released: the tenant gets its whole
-- reservation back.
local function drop_queued(prefix, queues, deadlines_key, tq_key, id, task, state, now, retention_s)
  redis.call('ZREM', queues[tonumber(task.tier) + 1], id)
  redis.call('ZREM', deadlines_key, id)
  tenant_dequeued(tq_key, task.tenant)
  flow_leave(prefix, tonumber(task.tier), task.tenant, id, tonumber(task.cost))
  redis.call('SREM', gateway_key(prefix, task.gateway), id)
  task_credit(prefix, task, now, tonumber(task.cost))
  task_finish(task_key(prefix, id), state, now, retention_s)
end

-- A released task ends: the pool gets its reservation back and the tenant the unused part.
-- usage < 0 means "unknown, charge nothing" (the client never got an answer). Only a task that
-- ran to its end ('settled') teaches the pool how much of a reservation work uses: one cut
-- short (client gone, node failed) says nothing about that, and a wave of failures would
-- otherwise teach the scheduler to overcommit just as the fleet is in trouble.
local function drop_released(prefix, resv_key, stats_key, id, task, state, usage, now, retention_s)
  local cost = tonumber(task.cost)
  unreserve_node(resv_key, task.node, cost)
  if task.guest then
    local left = redis.call('HINCRBY', guests_key(prefix), task.node, -1)
    if left <= 0 then redis.call('HDEL', guests_key(prefix), task.node) end
  end
  redis.call('ZREM', running_key(prefix),
    running_member(task.node, task.prompt_tokens, task.max_tokens, id))
  redis.call('SREM', gateway_key(prefix, task.gateway), id)
  local refund = cost
  if usage >= 0 then refund = cost - usage end
  inflight_done(prefix, task.tenant, cost)
  flow_settle(prefix, task, usage)
  if usage >= 0 and state == 'settled' then
    redis.call('HINCRBY', stats_key, 'settled', 1)
    redis.call('HINCRBY', stats_key, 'settled_cost', cost)
    redis.call('HINCRBY', stats_key, 'settled_usage', usage)
  end
  task_credit(prefix, task, now, refund)
  local extra = nil
  if usage >= 0 then extra = {'usage', fmt(usage)} end
  task_finish(task_key(prefix, id), state, now, retention_s, extra)
  return refund
end

-- A task's record (TASK_FIELDS by name), or nil when there is none.
local function load_task(tkey)
  local task = hash_fields(tkey, TASK_FIELDS)
  if not task.state then return nil end
  return task
end

-- The head of a queue: id, score (enqueue µs) and record. An entry without a queued record can
-- only come from a bug or a manual edit: it is dropped (record nil), which keeps the queue
-- moving. Returns nil when the queue is empty.
local function queue_head(prefix, queue_key, deadlines_key)
  local entry = redis.call('ZRANGE', queue_key, 0, 0, 'WITHSCORES')
  local head = entry[1]
  if not head then return nil end
  local task = load_task(task_key(prefix, head))
  if task == nil or task.state ~= 'queued' then
    redis.call('ZREM', queue_key, head)
    redis.call('ZREM', deadlines_key, head)
    return head, entry[2], nil
  end
  return head, entry[2], task
end

-- Fencing: a caller with an older epoch than the pool has seen is a deposed leader.
-- A newer epoch is recorded, so the first write of a new leader fences out the old one.
local function check_epoch(state_key, epoch)
  local current = tonumber(redis.call('HGET', state_key, 'epoch') or '0') or 0
  if epoch < current then return false, current end
  if epoch > current then redis.call('HSET', state_key, 'epoch', fmt(epoch)) end
  return true, epoch
end
