-- hint.lua: read what a capacity 429's retry hint is computed from (admission/hints.py), for
-- a request that is not admitting (a queued request past its deadline). Writes nothing.
--
-- KEYS[1]  state            HASH  zone, updated_us, drain_0..2 (tasks/s), red_clear_s (s)
-- KEYS[2]  clock            HASH  frozen_us (tests only)
-- KEYS[3..5] queue vip, normal, batch   ZSET
--
-- ARGV[1]  tier (0 VIP, 1 Normal, 2 Batch): count and drain the queues at this tier or above
--
-- Returns {zone, ahead, drain, red_clear_s, state_age_ms}, as admit.lua's capacity rejections
-- report them: zone (GREEN when no state was published), ahead = tasks queued at the tier or
-- above, drain = their tasks/s ('' when no leader measured it), red_clear_s = the leader's
-- estimate of the seconds until the pool leaves RED ('' when none), state_age_ms = now -
-- updated_us (ms; -1 when no state was published).

local tier = tonumber(ARGV[1])
local st = hash_fields(KEYS[1], HINT_FIELDS)
local ahead, drain, state_age_ms = hint_facts({KEYS[3], KEYS[4], KEYS[5]}, tier, st,
  now_us(KEYS[2]))
return {st.zone or 'GREEN', ahead, drain, st.red_clear_s or '', state_age_ms}
