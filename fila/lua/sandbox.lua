-- Runs once in every fresh Lua state, before any user script, with the full standard
-- library still present. It keeps private references to what the broker needs,
-- builds the environment scripts run in, and returns the entry points the broker
-- calls. Nothing a script can reach is more than pure computation.
--
-- Three promises, and how they are kept:
--
-- * Nothing crosses into Lua outside a protected call. The broker (sandbox.py) keeps
--   the memory cap lifted whenever no entry point runs, so that lupa can push
--   arguments and look up globals, which it does outside lua_pcall, without any
--   allocation failing there. Each entry point builds the message table, then calls
--   `arm` to set the cap, all inside lupa's lua_pcall and its own pcall. Entry points
--   never raise and return only booleans, numbers and strings. Scripts run in their
--   own environment table, never in the globals lupa reads.
--
-- * No call holds the thread much longer than its budget. Scripts run in a worker
--   coroutine that carries the budget hook; the broker's own code runs on the main
--   thread, which has none, so the hook can never fire in it. The hook reads the
--   calling thread's CPU time (`thread_clock`, so fsync or compaction threads do not
--   use the budget up) every `window` instructions, and a check also runs
--     - after every garbage collection cycle (a finalizer on a sentinel object), so
--       loops whose instructions allocate much (concatenation, string.rep, ...) are
--       checked as often as they allocate;
--     - when C library work charged by strings.lua adds up to DEBT_LIMIT.
--   One instruction can cost time proportional to the memory it touches (comparing
--   or concatenating long strings, walking an __index chain, a full collection when
--   memory runs out), so `window` shrinks as the state's memory grows: an instruction
--   window costs about the same at any size. The clock starts at the first check of a
--   call, so calls shorter than one window never read it.
--
-- * A failing script cannot keep running: the budget error cannot be caught by the
--   script's pcall, and once it fires every instruction raises it again. A worker
--   that failed is dropped with its pending to-be-closed variables unclosed.

local patterns_chunk, strings_chunk, arm, thread_clock, config_get, emit, budget_s, limits = ...

local sethook = debug.sethook
local co_create, co_resume, co_status, co_yield =
  coroutine.create, coroutine.resume, coroutine.status, coroutine.yield
local raw_pcall, raw_xpcall, error, type, tostring = pcall, xpcall, error, type, tostring
local rawget, rawset, rawlen, select, pairs = rawget, rawset, rawlen, select, pairs
local raw_setmetatable, getmetatable = setmetatable, getmetatable
local concat = table.concat
local math_type, math_tointeger, floor = math.type, math.tointeger, math.floor
local s_find, s_sub = string.find, string.sub
local utf8_len = utf8.len
local gc = collectgarbage
local load = load

local W_MAX = limits.window_max -- instructions between checks, at most
local W_MIN = limits.window_min -- and at least
local WINDOW_KB = limits.window_kb -- window * script memory in KiB stays about this
local DEBT_LIMIT = limits.debt_limit -- charged C work between checks
local BASE_KB -- the state's memory before any script; set at the end

local BUDGET = "CPU budget exhausted"

------------------------------------------------------------------------ the meter

local worker = nil -- the coroutine scripts run in
local active = false -- a script call is in progress
local exhausted = false
local started = false
local deadline = 0.0
local debt = 0
local planted = false

local budget_hook -- forward

local check -- forward

local sentinel_mt = {}
local function plant()
  planted = true
  raw_setmetatable({}, sentinel_mt)
end
-- a collection cycle finished: check at the next instruction of the script
sentinel_mt.__gc = function()
  planted = false
  if active and worker ~= nil then sethook(worker, budget_hook, "", 1) end
  plant()
end

-- instructions until the next check, for the state's present size
local function window_now()
  local script_kb = gc("count") - BASE_KB
  local w = script_kb > 0 and floor(WINDOW_KB / script_kb) or W_MAX
  if w > W_MAX then return W_MAX end
  if w < W_MIN then return W_MIN end
  return w
end

check = function()
  debt = 0
  if not active then return end
  local now = thread_clock()
  if not started then
    started = true
    deadline = now + budget_s
  elseif now > deadline then
    exhausted = true
    sethook(worker, budget_hook, "", 1)
    error(BUDGET, 0)
  end
  sethook(worker, budget_hook, "", window_now())
  if not planted then plant() end
end

budget_hook = function()
  if exhausted then error(BUDGET, 0) end
  check()
end

local function charge(units)
  debt = debt + units
  if debt > DEBT_LIMIT then check() end
end

-- A script must not be able to catch the budget error and keep running.
local function rethrow_if_exhausted(...)
  if exhausted then error(BUDGET, 0) end
  return ...
end
local function safe_pcall(f, ...)
  return rethrow_if_exhausted(raw_pcall(f, ...))
end
-- The message handler runs before the stack unwinds, and for an error raised by the
-- budget hook it would run with hooks off: it must not run at all then.
local function safe_xpcall(f, h, ...)
  local function handler(e)
    if exhausted then return e end
    return h(e)
  end
  return rethrow_if_exhausted(raw_xpcall(f, handler, ...))
end

------------------------------------------------------------------------ the worker

local function worker_body(fn, arg)
  while true do
    fn, arg = co_yield(fn(arg))
  end
end

-- Runs fn(arg) on the worker under the budget; returns ok, result-or-error.
local function run(fn, arg)
  if worker == nil or co_status(worker) ~= "suspended" then worker = co_create(worker_body) end
  sethook(worker, budget_hook, "", window_now())
  exhausted, started, debt, active = false, false, 0, true
  local ok, result = co_resume(worker, fn, arg)
  active = false
  if exhausted then
    worker = nil -- it would raise on its next instruction
    exhausted = false
    return false, BUDGET
  end
  if not ok then worker = nil end
  return ok, result
end

------------------------------------------------------------------------ libraries

local replacements = strings_chunk(patterns_chunk(), charge, load)
for name, fn in pairs(replacements.string) do string[name] = fn end
for name, fn in pairs(replacements.table) do table[name] = fn end
for name, fn in pairs(replacements.utf8) do utf8[name] = fn end
string.dump = nil

-- Finalizers run inside the garbage collector, outside the budget.
local function safe_setmetatable(t, mt)
  if type(mt) == "table" and rawget(mt, "__gc") ~= nil then
    error("__gc metamethods are not allowed", 2)
  end
  return raw_setmetatable(t, mt)
end

local current_hook = "load"

-- print: one log line per call, through the broker's rate-limited `fila.lua` logger
local PRINT_MAX = limits.print_max
local function safe_print(...)
  local n = select("#", ...)
  local parts = {}
  for i = 1, n do parts[i] = tostring((select(i, ...))) end
  local text = concat(parts, "\t", 1, n)
  if #text > PRINT_MAX then text = s_sub(text, 1, PRINT_MAX) end
  emit(current_hook, text)
end

-- fila.get: the value comes back through lupa's push, which the broker allows by
-- lifting the cap before it returns; the cap is set again at once
local function get(key)
  if type(key) ~= "string" then return nil end
  local value = config_get(key)
  arm()
  return value
end

local env = {}
for _, name in pairs({ "assert", "error", "ipairs", "next", "pairs", "rawequal", "rawget",
  "rawlen", "rawset", "select", "tonumber", "tostring", "type", "getmetatable", "_VERSION" }) do
  env[name] = _G[name]
end
env.pcall, env.xpcall, env.setmetatable, env.print = safe_pcall, safe_xpcall, safe_setmetatable, safe_print
env.tonumber = replacements.base.tonumber
env.string, env.table, env.math, env.utf8 = string, table, math, utf8
env.fila = { get = get }
env._G = env

-- The globals table lupa reads (it looks up `debug.traceback` before each call) is
-- out of the scripts' reach; empty it anyway.
local globals = _G
for name in pairs(globals) do globals[name] = nil end

------------------------------------------------------------------------ entry points

local hooks = {}

local function describe_error(e)
  if type(e) == "string" then return e end
  return "error object of type " .. type(e)
end

-- every entry point: ok, then its results or one error string
local function settle(ok, ...)
  if ok then return ... end
  local e = ...
  if type(e) ~= "string" then e = "error object is not a string" end
  return false, e
end

local function compile(name, source)
  hooks[name] = nil
  -- A hook must come from this script, not an earlier one. Raw: an earlier script's
  -- __newindex on its environment would otherwise run here, outside every budget.
  rawset(env, name, nil)
  current_hook = name
  arm()
  local chunk, err = load(source, "=" .. name, "t", env)
  if chunk == nil then return false, "compile", describe_error(err) end
  local ok, e = run(chunk)
  if not ok then return false, "run", describe_error(e) end
  local fn = rawget(env, name)
  if type(fn) ~= "function" then return false, "missing", name end
  hooks[name] = fn
  return true
end

local function valid_key(k)
  return type(k) == "string" and #k > 0 and #k <= 255 and not s_find(k, "\0", 1, true)
    and utf8_len(k) ~= nil
end

local function headers_from(omitted, ...)
  local n = select("#", ...)
  local kv = { ... }
  local headers = {}
  for i = 1, n, 2 do headers[kv[i]] = kv[i + 1] end
  return headers, omitted > 0 and omitted or nil
end

-- What a hook returned is read with raw access and type checks only: a metamethod
-- (__index, __len, __tostring, __eq) would run script code outside the worker.
local function enqueue_body(payload_size, queue, omitted, ...)
  local headers, headers_omitted = headers_from(omitted, ...)
  local msg = { headers = headers, payload_size = payload_size, queue = queue,
    headers_omitted = headers_omitted }
  current_hook = "on_enqueue"
  arm()
  local ok, r = run(hooks.on_enqueue, msg)
  if not ok then return false, describe_error(r) end
  if type(r) ~= "table" then return false, "on_enqueue must return a table, got " .. type(r) end
  local key, weight, throttle = rawget(r, "fairness_key"), rawget(r, "weight"), rawget(r, "throttle_keys")
  if key == nil then
    key = "default"
  elseif not valid_key(key) then
    return false, "fairness_key must be a string of 1 to 255 bytes of UTF-8 without NUL"
  end
  if weight == nil then
    weight = 1
  elseif math_type(weight) == "float" then
    weight = math_tointeger(weight) or weight -- 4.0, 2^2, 8/2: whole numbers
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
      if not valid_key(k) then
        return false, "throttle_keys must be strings of 1 to 255 bytes of UTF-8 without NUL"
      end
      plain_keys[i] = k
    end
    joined = concat(plain_keys, "\0", 1, count)
  end
  return true, key, floor(weight), joined
end

local function failure_body(id, attempts, queue, err, omitted, ...)
  local headers, headers_omitted = headers_from(omitted, ...)
  local msg = { id = id, headers = headers, attempts = attempts, queue = queue, error = err,
    headers_omitted = headers_omitted }
  current_hook = "on_failure"
  arm()
  local ok, r = run(hooks.on_failure, msg)
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
  return true, action, floor(delay)
end

local function load_script(name, source) return settle(raw_pcall(compile, name, source)) end
local function on_enqueue(...) return settle(raw_pcall(enqueue_body, ...)) end
local function on_failure(...) return settle(raw_pcall(failure_body, ...)) end

-- What scripts can reach, for the broker's creation-time check (static_check.py): one
-- line per global, "name" or "name member member ..." for the tables; taken before any
-- script adds globals of its own.
local function listing()
  local lines = {}
  for name, value in pairs(env) do
    if name ~= "_G" then
      local line = { name }
      if type(value) == "table" then
        for member in pairs(value) do line[#line + 1] = member end
      end
      lines[#lines + 1] = concat(line, " ")
    end
  end
  return concat(lines, "\n")
end
local names = listing()

gc("collect")
BASE_KB = gc("count")
plant()
return load_script, on_enqueue, on_failure, names
