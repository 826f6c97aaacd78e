-- Replacements for the library functions whose C code can run long inside one call,
-- where the budget hook cannot interrupt it.
--
-- The hook counts VM instructions, and the sandbox also bounds what one instruction
-- can cost (see sandbox.lua). A C library call is one instruction whatever it does,
-- so each function here either proves its C work small and charges it to the meter,
-- or does the work in Lua, where every step is an instruction:
--   * pattern functions: a sound bound on the C matcher's work (patterns.lua); over
--     LIMIT the Lua port of the matcher runs instead, or, for gmatch and gsub, a Lua
--     loop whose every step is a small C search;
--   * a plain string.find: at most #s * #p comparisons, else a Lua loop of memchr
--     and one comparison per candidate;
--   * table functions that touch elements: a table with a metatable can make every
--     element access walk a long __index chain in C, so its elements are moved in
--     Lua; plain tables keep the C code;
--   * table.sort compares in Lua unless a few short values are sorted;
--   * string.rep of empty strings, which C loops over without copying anything;
--   * functions that read a whole string without allocating (tonumber, utf8.len,
--     utf8.offset, arithmetic on strings) charge its length.
-- Semantics stay those of Lua 5.4: results, errors and their messages.
--
-- Runs once per Lua state, before the sandbox removes anything.

-- patterns.lua's module; the budget meter's charge(units); the private `load`; and
-- optionally the most work one C pattern call may do (tests lower it to run the Lua
-- matcher everywhere)
local patterns, charge, load_text, limit = ...

local s_find, s_match, s_gmatch, s_gsub = string.find, string.match, string.gmatch, string.gsub
local s_rep, s_sub, s_byte, s_len = string.rep, string.sub, string.byte, string.len
local t_insert, t_remove, t_move, t_sort = table.insert, table.remove, table.move, table.sort
local t_concat, t_unpack, t_pack = table.concat, table.unpack, table.pack
local tointeger, math_type, maxinteger = math.tointeger, math.type, math.maxinteger
local type, select, tostring, tonumber = type, select, tostring, tonumber
local error, raw_pcall, getmetatable, pairs = error, pcall, getmetatable, pairs

-- Most work one C pattern call may do, in matcher steps (about a nanosecond each).
local LIMIT = limit or 1e6

local p_costs, p_shape, p_has_specials = patterns.costs, patterns.shape, patterns.has_specials

------------------------------------------------------------------------------- args

local function typename(v, present)
  if not present then return "no value" end
  return type(v)
end

-- C: luaL_checklstring (numbers are converted, as C does)
local function checkstring(v, present, i, fname)
  local tv = type(v)
  if tv == "string" then return v end
  if tv == "number" then return tostring(v) end
  error(("bad argument #%d to '%s' (string expected, got %s)"):format(i, fname, typename(v, present)), 3)
end

-- C: luaL_optinteger
local function optinteger(v, i, fname, default)
  if v == nil then return default end
  local n = tointeger(v)
  if n ~= nil then return n end
  if tonumber(v) ~= nil then
    error(("bad argument #%d to '%s' (number has no integer representation)"):format(i, fname), 3)
  end
  error(("bad argument #%d to '%s' (number expected, got %s)"):format(i, fname, type(v)), 3)
end

local function posrelat(pos, len)
  if pos > 0 then return pos end
  if pos == 0 or pos < -len then return 1 end
  return len + pos + 1
end

------------------------------------------------------------------------------- errors
-- An error the C library raises with luaL_error names the Lua line that called it.
-- Raised from here, the same error must name the script's line, not this file's.

local CHUNK_PREFIX = "^fila%.strings:%d+: "

-- The errors of the C string and utf8 functions a wrapper calls under pcall. Raised
-- inside this module they name no line (the sandbox loads it without line
-- information) or one of its lines; either way they are raised again at the script's.
local LIBRARY_ERRORS = { "^bad argument #", "^malformed pattern", "^missing '%[' after",
  "^invalid capture index", "^invalid pattern capture", "^unfinished capture",
  "^too many captures", "^pattern too complex", "^invalid use of '%%'",
  "^invalid replacement value", "^initial position", "^resulting string too large" }
local function library_error(e)
  for i = 1, #LIBRARY_ERRORS do
    if s_find(e, LIBRARY_ERRORS[i]) then return true end
  end
  return false
end

-- After raw_pcall(f, ...): the results, or the error raised as C would have raised
-- it, naming the script's line. Must be tail-called by the wrapper the script called
-- (`return settle(raw_pcall(...))`), so that level 2 is the script. Errors of user
-- code (gsub replacement functions, metamethods) and of the budget pass unchanged.
local function settle(ok, ...)
  if ok then return ... end
  local e = ...
  if type(e) == "string" then
    if e == patterns.last_error then
      patterns.last_error = nil
      error(e, 2)
    end
    local stripped = s_gsub(e, CHUNK_PREFIX, "", 1)
    if library_error(stripped) then error(stripped, 2) end
  end
  error(e, 0)
end

------------------------------------------------------------------------------- find

-- find and match: the C function when its worst case fits the budget (charged up
-- front), else the step-counted Lua matcher. Every call here is a tail call, so the
-- script stays at error level 2 (see `settle`).
local function bounded_search(fast, slow, s, p, init, ls, starts)
  if starts < 1 then starts = 1 end
  local F, R, anchor = p_costs(p, ls, starts, LIMIT)
  local bound = anchor and R or (starts - 1) * F + R
  if bound <= LIMIT then
    charge(bound)
    local _, may_raise = p_shape(p)
    if not may_raise then return fast(s, p, init) end
    return settle(raw_pcall(fast, s, p, init))
  end
  return settle(raw_pcall(slow, s, p, init))
end


local function find(s, p, init, plain)
  local n = select("#", s, p)
  s = checkstring(s, n >= 1, 1, "find")
  p = checkstring(p, n >= 2, 2, "find")
  init = optinteger(init, 3, "find", 1)
  local ls, lp = #s, #p
  local starts = ls - posrelat(init, ls) + 2
  if plain or not p_has_specials(p) then
    local work = starts * lp + starts
    if work <= LIMIT then
      charge(work)
      return s_find(s, p, init, true)
    end
    return patterns.plain_find(s, p, init)
  end
  return bounded_search(s_find, patterns.find, s, p, init, ls, starts)
end

local function match(s, p, init)
  local n = select("#", s, p)
  s = checkstring(s, n >= 1, 1, "match")
  p = checkstring(p, n >= 2, 2, "match")
  init = optinteger(init, 3, "match", 1)
  local ls = #s
  local starts = ls - posrelat(init, ls) + 2
  return bounded_search(s_match, patterns.match, s, p, init, ls, starts)
end

------------------------------------------------------------------------------- steps
-- One step of gmatch or gsub: the first match of p at or after src, with find's
-- results (start, end, captures...). A C search when its bound is small and C would
-- use the matcher (string.find reads a pattern without specials as plain text, which
-- differs from the matcher only for ')'); else the Lua matcher.

local function step(s, p, src, literal_ok)
  local ls = #s
  local starts = ls - src + 2
  local F, R, anchor = p_costs(p, ls, starts, LIMIT)
  local bound = anchor and R or (starts - 1) * F + R
  if bound <= LIMIT and literal_ok then
    charge(bound)
    return s_find(s, p, src)
  end
  return patterns.scan(s, p, src)
end

-- can a C search stand for the matcher on p? (see step)
local function literal_ok(p)
  return p_has_specials(p) or not s_find(p, ")", 1, true)
end

------------------------------------------------------------------------------- gmatch

local function gmatch_iterator(s, fp, src)
  local ls = #s
  local ok_c = literal_ok(fp)
  local lastmatch = nil
  local function next_match()
    while src <= ls + 1 do
      local r = t_pack(step(s, fp, src, ok_c))
      local st = r[1]
      if st == nil then
        src = ls + 2
        return nil
      end
      local e = r[2] + 1
      if e == lastmatch and st == src then -- an empty match where the last one ended
        src = st + 1
      else
        src, lastmatch = e, e
        if r.n == 2 then return s_sub(s, st, e - 1) end
        return t_unpack(r, 3, r.n)
      end
    end
    return nil
  end
  return function() return settle(raw_pcall(next_match)) end
end

local function gmatch(s, p, init)
  local n = select("#", s, p)
  s = checkstring(s, n >= 1, 1, "gmatch")
  p = checkstring(p, n >= 2, 2, "gmatch")
  init = optinteger(init, 3, "gmatch", 1)
  local ls = #s
  -- C: start position, and past the end when init is
  local src = posrelat(init, ls)
  if src > ls + 1 then src = ls + 2 end
  -- in gmatch a leading '^' is an ordinary character: escaped, find reads it so too
  local fp = (s_byte(p, 1) == 94) and ("%" .. p) or p
  -- the C iterator's calls scan at most ls + 2 positions in all, each call ending with
  -- a match (and maybe one rejected empty match)
  local F, R = p_costs(fp, ls, ls + 2, LIMIT)
  local total = (ls + 2) * (F + 2 * R)
  local _, may_raise = p_shape(fp)
  if total <= LIMIT and not may_raise then
    charge(total)
    return s_gmatch(s, p, init)
  end
  return gmatch_iterator(s, fp, src)
end

------------------------------------------------------------------------------- gsub

-- C: add_s, the replacement string with %0-%9 and %%
local function expand(out, no, rs, s, st, e, capture_of)
  local i, lr = 1, #rs
  while true do
    local pct = s_find(rs, "%", i, true)
    if pct == nil then break end
    if pct > i then
      no = no + 1
      out[no] = s_sub(rs, i, pct - 1)
    end
    local c = s_byte(rs, pct + 1)
    if c == 37 then -- '%%'
      no = no + 1
      out[no] = "%"
    elseif c == 48 then -- '%0'
      no = no + 1
      out[no] = s_sub(s, st, e - 1)
    elseif c ~= nil and c >= 49 and c <= 57 then
      local v = capture_of(c - 49)
      no = no + 1
      out[no] = (math_type(v) == "integer") and tostring(v) or v
    else
      patterns.last_error = "invalid use of '%' in replacement string"
      error(patterns.last_error, 0)
    end
    i = pct + 2
  end
  if i <= lr then
    no = no + 1
    out[no] = s_sub(rs, i, lr)
  end
  return no
end

local function gsub_loop(s, p, repl, max_n, tr, exact)
  local ls = #s
  local anchor = s_byte(p, 1) == 94
  local ok_c = (not exact) and literal_ok(p)
  local rs = (tr == "string" or tr == "number") and tostring(repl) or nil
  local out, no = {}, 0
  local src, lastmatch, count, changed = 1, nil, 0, false
  local st, e, caps, ncaps
  -- capture i (0-based) of the current match, as C's get_onecapture
  local function capture_of(i)
    if exact then return patterns.capture(i, st, e) end
    if i >= ncaps then
      if i ~= 0 then
        patterns.last_error = "invalid capture index %" .. (i + 1)
        error(patterns.last_error, 0)
      end
      return s_sub(s, st, e - 1)
    end
    return caps[i + 1]
  end
  local function search_from(from)
    if exact then
      local a, b = patterns.search(s, p, from)
      return a, b
    end
    local function take(a, b, ...)
      if a == nil then return nil end
      caps = { ... }
      ncaps = select("#", ...)
      return a, b + 1
    end
    return take(step(s, p, from, ok_c))
  end
  while count < max_n do
    st, e = search_from(src)
    if st == nil then break end
    if st == src and e == lastmatch then -- an empty match where the last one ended
      if src > ls then break end
      no = no + 1
      out[no] = s_sub(s, src, src)
      src = src + 1
    else
      if st > src then
        no = no + 1
        out[no] = s_sub(s, src, st - 1)
      end
      count = count + 1
      local whole = s_sub(s, st, e - 1)
      if rs ~= nil then
        no = expand(out, no, rs, s, st, e, capture_of)
        changed = true
      else
        local v
        if tr == "function" then
          local levels = exact and patterns.levels() or ncaps
          if levels == 0 then
            v = repl(whole)
          else
            local args = {}
            for i = 1, levels do args[i] = capture_of(i - 1) end
            v = repl(t_unpack(args, 1, levels))
          end
        else
          v = repl[capture_of(0)]
        end
        if not v then
          no = no + 1
          out[no] = whole
        elseif type(v) == "string" or type(v) == "number" then
          no = no + 1
          out[no] = tostring(v)
          changed = true
        else
          patterns.last_error = "invalid replacement value (a " .. type(v) .. ")"
          error(patterns.last_error, 0)
        end
      end
      src, lastmatch = e, e
    end
    if anchor then break end
  end
  if not changed then return s, count end
  if src <= ls then
    no = no + 1
    out[no] = s_sub(s, src, ls)
  end
  return t_concat(out, "", 1, no), count
end

local function gsub(s, p, repl, max_n)
  local n = select("#", s, p, repl)
  s = checkstring(s, n >= 1, 1, "gsub")
  p = checkstring(p, n >= 2, 2, "gsub")
  local tr = type(repl)
  if tr ~= "string" and tr ~= "number" and tr ~= "function" and tr ~= "table" then
    error("bad argument #3 to 'gsub' (string/function/table expected, got "
      .. typename(repl, n >= 3) .. ")", 2)
  end
  local ls = #s
  max_n = optinteger(max_n, 4, "gsub", ls + 1)
  local balanced, may_raise = p_shape(p)
  -- the whole C call: one attempt per position, plus the replacement string per match
  local _, R, anchor = p_costs(p, ls, ls + 2, LIMIT)
  local rlen = (tr == "string" or tr == "number") and #tostring(repl) or 1
  local total = (anchor and 1 or ls + 1) * (R + rlen)
  local plain_repl = tr ~= "table" or getmetatable(repl) == nil
  if total <= LIMIT and plain_repl then
    charge(total)
    -- a replacement string raises on a bad '%' escape, and functions and tables on
    -- a bad result: those go through settle, to name the script's line
    if not may_raise and (tr == "number" or (tr == "string" and not s_find(repl, "%", 1, true))) then
      return s_gsub(s, p, repl, max_n)
    end
    return settle(raw_pcall(s_gsub, s, p, repl, max_n))
  end
  -- patterns whose captures do not pair up need the matcher's lazy capture reads
  return settle(raw_pcall(gsub_loop, s, p, repl, max_n, tr, not balanced))
end

------------------------------------------------------------------------------- rep

local function rep(s, n, sep)
  -- C loops n times even when there is nothing to copy
  if s == "" and (sep == nil or sep == "") and tointeger(n) ~= nil then return "" end
  return s_rep(s, n, sep)
end

------------------------------------------------------------------------------- scans
-- Reading a long string costs time, not memory, so no collection cycle (the other
-- trigger of a budget check) marks it: charge the bytes.

local c_tonumber = tonumber
local function to_number(...)
  local v, base = ...
  if select("#", ...) == 0 then error("bad argument #1 to 'tonumber' (value expected)", 2) end
  if type(v) == "string" then charge(#v) end
  if base == nil then return (c_tonumber(v)) end
  return settle(raw_pcall(c_tonumber, v, base))
end

local u_len, u_offset = utf8.len, utf8.offset
local function utf8_len(s, ...)
  if type(s) == "string" then charge(#s) end
  return settle(raw_pcall(u_len, s, ...))
end
local function utf8_offset(s, ...)
  if type(s) == "string" then charge(#s) end
  return settle(raw_pcall(u_offset, s, ...))
end

-- the string metatable's arithmetic (C: lstrlib's trymt) converts with a full scan
local ARITH_ERROR = "^attempt to perform arithmetic on a "
local function arith_settle(ok, ...)
  if ok then return ... end
  local e = ...
  if type(e) == "string" and s_find(e, ARITH_ERROR) then error(e, 2) end
  error(e, 0)
end
local function arith(original)
  return function(a, b)
    local cost = 0
    if type(a) == "string" then cost = #a end
    if type(b) == "string" then cost = cost + #b end
    charge(cost)
    return arith_settle(raw_pcall(original, a, b))
  end
end
local string_mt = getmetatable("")
for _, event in pairs({ "__add", "__sub", "__mul", "__mod", "__pow", "__div", "__idiv", "__unm" }) do
  if string_mt[event] ~= nil then string_mt[event] = arith(string_mt[event]) end
end

------------------------------------------------------------------------------- tables
-- Element-wise C table functions read and write through metamethods; on a table with
-- a metatable each access may walk an __index chain of up to 2,000 tables without an
-- instruction. Such tables are handled in Lua; plain tables keep the C code, whose
-- work is proportional to the table (memory the sandbox bounds).

local function plain(t)
  return type(t) == "table" and getmetatable(t) == nil
end

-- C: aux_getn for a table with metamethods
local function length(t, fname)
  local n = #t
  if math_type(n) ~= "integer" then
    error("object length is not an integer", 3)
  end
  return n
end

local function insert(...)
  local nargs = select("#", ...)
  local t = ...
  if plain(t) or type(t) ~= "table" then return t_insert(...) end
  local e = length(t, "insert") + 1
  if nargs == 2 then
    t[e] = select(2, ...)
    return
  end
  if nargs ~= 3 then error("wrong number of arguments to 'insert'", 2) end
  local _, p, v = ...
  local pos = tointeger(p)
  if pos == nil then
    error("bad argument #2 to 'insert' (number expected, got " .. type(p) .. ")", 2)
  end
  if pos < 1 or pos > e then
    error("bad argument #2 to 'insert' (position out of bounds)", 2)
  end
  for i = e, pos + 1, -1 do t[i] = t[i - 1] end
  t[pos] = v
end

local function remove(t, pos)
  if plain(t) or type(t) ~= "table" then
    if pos == nil then return t_remove(t) end
    return t_remove(t, pos)
  end
  local size = length(t, "remove")
  if pos == nil then
    pos = size
  else
    local p2 = tointeger(pos)
    if p2 == nil then
      error("bad argument #2 to 'remove' (number expected, got " .. type(pos) .. ")", 2)
    end
    pos = p2
    if pos ~= size and (pos < 1 or pos > size + 1) then
      error("bad argument #2 to 'remove' (position out of bounds)", 2)
    end
  end
  local result = t[pos]
  while pos < size do
    t[pos] = t[pos + 1]
    pos = pos + 1
  end
  t[pos] = nil
  return result
end

-- C: tmove. Large ranges move in Lua too: C would loop over absent (nil) elements
-- without allocating anything.
local function move(a1, f, e, t, a2)
  local fi, ei, ti = tointeger(f), tointeger(e), tointeger(t)
  local dest = a2
  if dest == nil then dest = a1 end
  if fi == nil or ei == nil or ti == nil or ei < fi or not (fi > 0 or ei < maxinteger + fi) then
    return t_move(a1, f, e, t, a2) -- nothing to move, or C raises the error
  end
  local n = ei - fi + 1
  if ti > maxinteger - n + 1 then return t_move(a1, f, e, t, a2) end
  if n <= 64 and plain(a1) and plain(dest) then return t_move(a1, f, e, t, a2) end
  t_move(a1, 1, 0, ti, a2) -- moves nothing; C checks that both can be indexed
  if ti > ei or ti <= fi or (a2 ~= nil and a1 ~= dest) then
    for i = 0, n - 1 do dest[ti + i] = a1[fi + i] end
  else
    for i = n - 1, 0, -1 do dest[ti + i] = a1[fi + i] end
  end
  return dest
end

-- the default order, as a function the hook can interrupt; its own chunk name keeps
-- comparison errors readable ("table.sort:1: attempt to compare nil with number")
local default_less = load_text("return function(a, b) return a < b end", "=table.sort")()

local SORT_IN_C = 64 -- a few values of at most this many bytes sort in C
local function sort(t, comp)
  if comp == nil and plain(t) then
    local n = #t
    if n <= SORT_IN_C then
      for i = 1, n do
        local v = t[i]
        local tv = type(v)
        if tv == "string" then
          if #v > SORT_IN_C then return t_sort(t, default_less) end
        elseif tv ~= "number" then
          return t_sort(t, default_less)
        end
      end
      return t_sort(t)
    end
    return t_sort(t, default_less)
  end
  if plain(t) or type(t) ~= "table" then return t_sort(t, comp or default_less) end
  -- sort a plain copy, so that C reads no element through a metamethod
  local n = length(t, "sort")
  local copy = {}
  for i = 1, n do copy[i] = t[i] end
  t_sort(copy, comp or default_less)
  for i = 1, n do t[i] = copy[i] end
end

local function concat(t, sep, i, j)
  if plain(t) or type(t) ~= "table" then return t_concat(t, sep, i, j) end
  i = i == nil and 1 or i
  j = j == nil and length(t, "concat") or j
  local ii, jj = tointeger(i), tointeger(j)
  if ii == nil or jj == nil then return t_concat(t, sep, i, j) end -- C raises
  local parts = {}
  for k = ii, jj do
    local v = t[k]
    local tv = type(v)
    if tv ~= "string" and tv ~= "number" then
      error(("invalid value (at index %d) in table for 'concat'"):format(k), 2)
    end
    parts[k - ii + 1] = v
  end
  return t_concat(parts, sep, 1, jj - ii + 1)
end

local function unpack(t, i, j)
  if plain(t) or type(t) ~= "table" then return t_unpack(t, i, j) end
  i = i == nil and 1 or i
  j = j == nil and length(t, "unpack") or j
  local ii, jj = tointeger(i), tointeger(j)
  if ii == nil or jj == nil or jj < ii or jj - ii >= 1e6 then return t_unpack(t, i, j) end
  local copy = {}
  for k = ii, jj do copy[k - ii + 1] = t[k] end
  return t_unpack(copy, 1, jj - ii + 1)
end

return {
  base = { tonumber = to_number },
  utf8 = { len = utf8_len, offset = utf8_offset },
  string = { find = find, match = match, gmatch = gmatch, gsub = gsub, rep = rep },
  table = { insert = insert, remove = remove, move = move, sort = sort, concat = concat,
    unpack = unpack },
}
