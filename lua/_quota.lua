-- _quota.lua: quota levels (buckets and allowances of a tenant and its enclosing levels).
-- Prepended to every script, after the files before it in admission/scripts.py LIBRARY (each
-- uses only what those define); not a script of its own. Units as in _lib.lua.

-- Quota levels. A request debits its tenant's bucket (the key level, bucket_key()) and the
-- bucket of every enclosing level (a team, its organisation: quota_key()), all in the admit
-- call, and is refused when any of them cannot pay. Each level may also have a daily and a
-- monthly allowance of tokens (UTC days and months of Redis TIME), kept in its bucket's hash:
-- day (days since 1970-01-01) and day_used, month (year x 12 + month - 1) and month_used. A
-- task records the day and the month each level counted it in (quota_day, quota_month: one
-- per level, period_of()) when an allowance applies, so that its refund at the end goes back
-- to that period only if the level still counts in it (task_credit()). Each
-- level's hash also counts `held`: the tokens its live tasks (queued or released) reserved
-- there, whose unused part comes back when they end. A bucket that never refills (rate 0)
-- is only out for good once what it holds and `held` together cannot pay: until then its
-- tenant is told to come back, not that the quota is spent.
local DAY_US = 86400000000

-- Year and month (1..12) of a day counted from 1970-01-01 (the proleptic Gregorian calendar,
-- by eras of 400 years).
local function civil_of(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The day (from 1970-01-01) of the first of month `m` (1..12) of year `y`.
local function first_of_month(y, m)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5)
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end

local function month_of_day(day)
  local y, m = civil_of(day)
  return y * 12 + m - 1
end

-- The period an allowance counts in: the clock's (`index`), or the next one if it is stored:
-- the clock stepped back since (a failover to a replica whose clock is behind, an NTP step)
-- across midnight or a month's end, and counting in the clock's would read the later period's
-- use as none, and write over it. A period stored further ahead came from a clock that ran
-- ahead and was set right: honouring it would pile every day's use into that one until the
-- clock reached it, so the clock's period is taken, as it always was.
local function period_of(f, kind, index)
  local at = tonumber(kind == 'month' and f[3] or f[1])
  if at ~= nil and at == index + 1 then return at end
  return index
end

-- Tokens used so far in the current period of an allowance ('day' or 'month'), from a hash
-- read with HMGET day, day_used, month, month_used (`f`).
local function period_used(f, kind, index)
  local at, used = f[1], f[2]
  if kind == 'month' then at, used = f[3], f[4] end
  if tonumber(at) == index then return tonumber(used) or 0 end
  return 0
end

-- Why a level cannot pay `cost` now, as the ms until it can and the kind ('bucket', 'daily',
-- 'monthly', 'held'), or nil when it can. -1: never (a bucket that does not refill, with too
-- little held by live tasks to make up the difference); 0 with 'held': a bucket that does not
-- refill but could pay once live tasks give back their unused tokens, at a time unknown here.
-- `lvl`: {key, rate, burst, daily, monthly}; sets lvl.level (micro-tokens at `now`).
local function level_short(lvl, now, cost)
  lvl.level = bucket_level(lvl.key, now, lvl.rate, lvl.burst)
  local need, wait, kind = cost * 1000000, nil, nil
  if lvl.level < need then
    wait, kind = -1, 'bucket'
    if lvl.rate > 0 then
      wait = math.ceil((need - lvl.level) / lvl.rate / 1000)
    else
      local held = tonumber(redis.call('HGET', lvl.key, 'held') or '0') or 0
      if lvl.level + held * 1000000 >= need then wait, kind = 0, 'held' end
    end
  end
  if lvl.daily > 0 or lvl.monthly > 0 then
    local f = redis.call('HMGET', lvl.key, 'day', 'day_used', 'month', 'month_used')
    local day = period_of(f, 'day', math.floor(now / DAY_US))
    if lvl.daily > 0 and period_used(f, 'day', day) + cost > lvl.daily then
      local w = math.ceil(((day + 1) * DAY_US - now) / 1000)
      if wait == nil or (wait >= 0 and w > wait) then wait, kind = w, 'daily' end
    end
    if lvl.monthly > 0 then
      local month = period_of(f, 'month', month_of_day(math.floor(now / DAY_US)))
      local y, m = math.floor(month / 12), month % 12 + 1
      if period_used(f, 'month', month) + cost > lvl.monthly then
        if m == 12 then y, m = y + 1, 1 else m = m + 1 end
        local w = math.ceil((first_of_month(y, m) * DAY_US - now) / 1000)
        if wait == nil or (wait >= 0 and w > wait) then wait, kind = w, 'monthly' end
      end
    end
  end
  return wait, kind
end

-- A level pays `cost`: its bucket is debited, the task's reservation is held there until it
-- ends (task_credit()), and its allowances count it. Returns the day and month they counted it
-- in, nil and nil for a level without allowances: after the clock stepped back these are the
-- later periods, not the clock's, and only they tell the refund where the tokens went.
local function level_debit(lvl, now, cost)
  bucket_store(lvl.key, lvl.level - cost * 1000000, now, lvl.rate, lvl.burst)
  redis.call('HINCRBY', lvl.key, 'held', cost)
  if lvl.daily > 0 or lvl.monthly > 0 then
    local f = redis.call('HMGET', lvl.key, 'day', 'day_used', 'month', 'month_used')
    local day = period_of(f, 'day', math.floor(now / DAY_US))
    local month = period_of(f, 'month', month_of_day(math.floor(now / DAY_US)))
    redis.call('HSET', lvl.key, 'day', fmt(day), 'day_used',
      fmt(period_used(f, 'day', day) + cost), 'month', fmt(month), 'month_used',
      fmt(period_used(f, 'month', month) + cost))
    return day, month
  end
  return nil, nil
end

-- Give `tokens` back to a level (negative takes more): its bucket, and each of its allowances
-- whose period the task was counted in (`day`, `month`; nil: none) is still the one the level
-- counts in now (period_of(): the later one while the clock is behind a step back).
local function level_credit(key, now, tokens, day, month)
  bucket_credit(key, now, tokens)
  if day == nil and month == nil then return end
  local f = redis.call('HMGET', key, 'day', 'day_used', 'month', 'month_used')
  local today = math.floor(now / DAY_US)
  if day ~= nil and tonumber(f[1]) == day and period_of(f, 'day', today) == day then
    redis.call('HSET', key, 'day_used', fmt(math.max(0, (tonumber(f[2]) or 0) - tokens)))
  end
  if month ~= nil and tonumber(f[3]) == month
      and period_of(f, 'month', month_of_day(today)) == month then
    redis.call('HSET', key, 'month_used', fmt(math.max(0, (tonumber(f[4]) or 0) - tokens)))
  end
end

-- The words of a task's space-separated field, or an empty list when it has none.
local function words_of(text)
  local out = {}
  if text then
    for word in string.gmatch(text, '%S+') do table.insert(out, word) end
  end
  return out
end

-- The periods level `i` of a task counted it in (1: the key's own, then its record's levels in
-- order): day and month, nil for a level without allowances ('-'). A record from before the
-- periods were kept per level holds one day, the clock's at its admit, for every level, and
-- no month: that day's.
local function task_periods(days, months, i)
  if months == nil then
    local day = tonumber(days[1])
    return day, day and month_of_day(day)
  end
  return tonumber(days[i]), tonumber(months[i])
end

-- A level no longer holds a task of `cost` (it ended). A task admitted before levels counted
-- `held` takes nothing below zero.
local function level_unhold(key, cost)
  if redis.call('HINCRBY', key, 'held', -cost) <= 0 then redis.call('HDEL', key, 'held') end
end

-- A task ended: its tenant and enclosing levels (its record's levels: names, space-separated)
-- get `tokens` back and no longer hold its reservation.
local function task_credit(prefix, task, now, tokens)
  local days = words_of(task.quota_day)
  local months = task.quota_month and words_of(task.quota_month) or nil
  local cost = tonumber(task.cost) or 0
  local keys = {bucket_key(prefix, task.tenant)}
  for _, name in ipairs(words_of(task.levels)) do
    table.insert(keys, quota_key(prefix, name))
  end
  for i, key in ipairs(keys) do
    local day, month = task_periods(days, months, i)
    level_credit(key, now, tokens, day, month)
    level_unhold(key, cost)
  end
end
