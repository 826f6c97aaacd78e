-- Runs once in every fresh Lua state, before any user script, with the full
-- standard library still present. It keeps private references to the few
-- functions the broker needs (the debug hook, the CPU clock), then removes
-- everything a policy script must not reach, and returns the entry points the
-- broker calls. Everything user code can see afterwards is pure computation.

local sethook = debug.sethook
local clock = os.clock
local raw_pcall, raw_xpcall, error, type, tostring = pcall, xpcall, error, type, tostring
local rawget, rawlen = rawget, rawlen
local pack, concat, math_type = table.pack, table.concat, math.type
local collectgarbage_ = collectgarbage

local BUDGET = "instruction budget exhausted"
local deadline = 0
local exhausted = false

local function budget_hook()
  if exhausted or clock() > deadline then
    exhausted = true
    error(BUDGET, 0)
  end
end

-- A script must not be able to catch the budget error and keep running.
local function rethrow_if_exhausted(...)
  if exhausted then error(BUDGET, 0) end
  return ...
end
pcall = function(f, ...) return rethrow_if_exhausted(raw_pcall(f, ...)) end
-- The message handler runs before the stack unwinds, and for an error raised by
-- the budget hook it would run with hooks off: it must not run at all then.
xpcall = function(f, h, ...)
  local function handler(e)
    if exhausted then return e end
    return h(e)
  end
  return rethrow_if_exhausted(raw_xpcall(f, handler, ...))
end

-- Some C library functions loop without executing Lua instructions, so the
-- budget hook cannot interrupt them; bound their work up front instead.
local s_find, s_match, s_gmatch, s_gsub, s_rep = string.find, string.match, string.gmatch, string.gsub, string.rep
local t_move, raw_setmetatable = table.move, setmetatable
local MAX_PATTERN_WORK = 1e7

-- Backtracking costs about #subject ^ (quantifiers + 1) in the worst case, and
-- even a plain search can compare every subject position with the whole pattern.
local function check_pattern(s, p, plain)
  local subject, pattern = tostring(s), tostring(p)
  local work = #subject * #pattern
  if not plain then
    local _, quantifiers = s_gsub(s_gsub(pattern, "%%.", ""), "[%*%+%-%?]", "")
    work = work + (#subject) ^ (quantifiers + 1)
  end
  if work > MAX_PATTERN_WORK then
    error("pattern too complex for a subject of " .. #subject .. " bytes", 3)
  end
end
string.find = function(s, p, init, plain)
  check_pattern(s, p, plain)
  return s_find(s, p, init, plain)
end
string.match = function(s, p, init) check_pattern(s, p); return s_match(s, p, init) end
string.gmatch = function(s, p, init) check_pattern(s, p); return s_gmatch(s, p, init) end
string.gsub = function(s, p, r, n) check_pattern(s, p); return s_gsub(s, p, r, n) end
string.rep = function(s, n, sep)
  if #tostring(s) == 0 and (sep == nil or #tostring(sep) == 0) then return "" end
  return s_rep(s, n, sep)
end
table.move = function(a1, f, e, t, a2)
  if e - f > 1e6 then error("table.move range too large", 2) end
  return t_move(a1, f, e, t, a2)
end
-- Finalizers run inside the garbage collector, where the budget hook may not be set.
setmetatable = function(t, mt)
  if type(mt) == "table" and rawget(mt, "__gc") ~= nil then
    error("__gc metamethods are not allowed", 2)
  end
  return raw_setmetatable(t, mt)
end

os, io, debug, package, require = nil, nil, nil, nil, nil
load, loadstring, dofile, loadfile = nil, nil, nil, nil
collectgarbage, coroutine, python = nil, nil, nil
string.dump = nil

-- Calls fn(...) under the instruction budget; returns ok, result-or-error.
local function guarded(budget_s, fn, ...)
  exhausted = false
  deadline = clock() + budget_s
  sethook(budget_hook, "", 1000)
  local result = pack(raw_pcall(fn, ...))
  sethook()
  exhausted = false
  return result[1], result[2]
end

local function run_chunk(budget_s, chunk)
  return guarded(budget_s, chunk)
end

-- What a hook returned is read after the budget hook is off, so only with raw
-- access and type checks: a metamethod (__index, __len, __tostring, __eq) could
-- otherwise run script code with no budget.
local function describe_error(e)
  if type(e) == "string" then return e end
  return "error object of type " .. type(e)
end

-- on_enqueue result -> ok, fairness_key, weight, throttle keys joined by "\0"
local function run_on_enqueue(budget_s, fn, headers, payload_size, queue)
  local ok, r = guarded(budget_s, fn, { headers = headers, payload_size = payload_size, queue = queue })
  if not ok then return false, describe_error(r) end
  if type(r) ~= "table" then return false, "on_enqueue must return a table, got " .. type(r) end
  local key, weight, throttle = rawget(r, "fairness_key"), rawget(r, "weight"), rawget(r, "throttle_keys")
  if key == nil then
    key = "default"
  elseif type(key) ~= "string" or #key == 0 or #key > 255 then
    return false, "fairness_key must be a non-empty string of at most 255 bytes"
  end
  if weight == nil then
    weight = 1
  elseif math_type(weight) == "float" and weight == weight // 1 then
    weight = weight // 1
  end
  if math_type(weight) ~= "integer" or weight < 1 or weight > 1000000 then
    return false, "weight must be an integer from 1 to 1000000"
  end
  local joined = ""
  if throttle ~= nil then
    if type(throttle) ~= "table" then return false, "throttle_keys must be a list of strings" end
    local count = rawlen(throttle)
    if count > 64 then return false, "at most 64 throttle_keys" end
    local plain_keys = {}
    for i = 1, count do
      local k = rawget(throttle, i)
      if type(k) ~= "string" or #k == 0 or #k > 255 or s_find(k, "\0", 1, true) then
        return false, "throttle_keys must be a list of non-empty strings of at most 255 bytes"
      end
      plain_keys[i] = k
    end
    joined = concat(plain_keys, "\0")
  end
  return true, key, weight, joined
end

-- on_failure result -> ok, action ("retry" or "dlq"), delay_ms
local function run_on_failure(budget_s, fn, id, headers, attempts, queue, err)
  local ok, r = guarded(budget_s, fn, { id = id, headers = headers, attempts = attempts, queue = queue, error = err })
  if not ok then return false, describe_error(r) end
  if type(r) ~= "table" then return false, "on_failure must return a table, got " .. type(r) end
  local action, delay = rawget(r, "action"), rawget(r, "delay_ms")
  if action ~= "retry" and action ~= "dlq" then
    return false, 'action must be "retry" or "dlq"'
  end
  if delay == nil then
    delay = 0
  elseif type(delay) ~= "number" or delay ~= delay or delay < 0 or delay > 31536000000 then
    return false, "delay_ms must be a number from 0 to one year in ms"
  end
  return true, action, delay // 1
end

local function run_collect(budget_s)
  return guarded(budget_s, collectgarbage_, "collect")
end

return run_chunk, run_on_enqueue, run_on_failure, run_collect
