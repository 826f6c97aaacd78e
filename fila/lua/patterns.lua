-- Lua patterns, twice over: a port of Lua 5.4's matcher (lstrlib.c) written in Lua,
-- and a sound upper bound on the work the C matcher can do for a pattern.
--
-- Why: the C matcher backtracks inside one C call, where the instruction hook
-- cannot interrupt it (`string.find(string.rep("a", 2000), "a*" .. string.rep("a",
-- 1000) .. "b")` runs for seconds). The sandbox keeps the C matcher when the bound
-- below says its worst case is small, and otherwise runs this port, whose every
-- step is a VM instruction the budget hook counts. The port must therefore behave
-- exactly like the C code: same results, same errors, raised at the same moment
-- (a malformed pattern is only reported when the matcher reaches the bad item).
--
-- Positions are 1-based "pointers": a subject of length n has positions 1..n+1,
-- where n+1 plays the part of C's `src_end` (the terminating NUL).
--
-- Runs once per Lua state, before the sandbox removes anything, so the C string
-- functions it keeps are the originals.

local byte, sub, char = string.byte, string.sub, string.char
local c_gsub, c_find = string.gsub, string.find
local unpack = table.unpack
local error = error
local huge = math.huge

local M = {}

-- Raises an error the C library would raise with luaL_error. The message is kept in
-- M.last_error so the caller can re-raise it at the script's line (see strings.lua).
local function fail(msg)
  M.last_error = msg
  error(msg, 0)
end

local MAXCCALLS = 200 -- C: MAXCCALLS, the matcher's recursion limit
local MAXCAPTURES = 32 -- C: LUA_MAXCAPTURES
local CAP_UNFINISHED, CAP_POSITION = -1, -2

local ESC, LBRACK, RBRACK, CARET, DASH = 37, 91, 93, 94, 45 -- % [ ] ^ -
local LPAREN, RPAREN, DOLLAR, DOT = 40, 41, 36, 46 -- ( ) $ .
local STAR, PLUS, QUEST = 42, 43, 63 -- * + ?
local LETTER_B, LETTER_F, DIGIT0, DIGIT9 = 98, 102, 48, 57

-- Character classes (%a, %d, ...) answer exactly what the C library answers in this
-- process's locale: each class's members are read from the C matcher, on first use.
local CLASS_LETTERS = { [97] = true, [99] = true, [100] = true, [103] = true, [108] = true,
  [112] = true, [115] = true, [117] = true, [119] = true, [120] = true, [122] = true }
local class_members = {}

local function members(letter)
  local set = class_members[letter]
  if set == nil then
    local all = {}
    for c = 0, 255 do all[c + 1] = c end
    local found = c_gsub(char(unpack(all)), "[^%" .. char(letter) .. "]", "")
    set = {}
    for i = 1, #found do set[byte(found, i)] = true end
    class_members[letter] = set
  end
  return set
end

-- The subject and pattern of the match in progress. Matching never calls user
-- code, so one set of module-level slots serves every match, and each entry point
-- resets them.
local SRC, SLEN, PAT, PLEN = "", 0, "", 0
local LEVEL, DEPTH = 0, MAXCCALLS
local CAP_INIT, CAP_LEN = {}, {}

local function match_class(c, cl)
  local lower = cl
  if cl >= 65 and cl <= 90 then lower = cl + 32 end
  if not CLASS_LETTERS[lower] then return cl == c end
  local res = members(lower)[c] == true
  if cl >= 97 and cl <= 122 then return res end
  return not res
end

-- p: index of '['; ec: index of the closing ']'
local function matchbracketclass(c, p, ec)
  local pat = PAT
  local sig = true
  if byte(pat, p + 1) == CARET then
    sig = false
    p = p + 1
  end
  while true do
    p = p + 1
    if p >= ec then break end
    local pc = byte(pat, p)
    if pc == ESC then
      p = p + 1
      if match_class(c, byte(pat, p)) then return sig end
    elseif byte(pat, p + 1) == DASH and p + 2 < ec then
      p = p + 2
      if pc <= c and c <= byte(pat, p) then return sig end
    elseif pc == c then
      return sig
    end
  end
  return not sig
end

-- index just after the single-character class that starts at p
local function classend(p)
  local pat = PAT
  local pc = byte(pat, p)
  p = p + 1
  if pc == ESC then
    if p > PLEN then fail("malformed pattern (ends with '%')") end
    return p + 1
  elseif pc == LBRACK then
    if byte(pat, p) == CARET then p = p + 1 end
    repeat -- look for a ']'
      if p > PLEN then fail("malformed pattern (missing ']')") end
      local cc = byte(pat, p)
      p = p + 1
      if cc == ESC and p <= PLEN then p = p + 1 end -- skip escapes (e.g. '%]')
    until byte(pat, p) == RBRACK
    return p + 1
  end
  return p
end

-- classend for the analysis: nil where the matcher would raise "malformed pattern"
local function classend_or_nil(p)
  local pat = PAT
  local pc = byte(pat, p)
  p = p + 1
  if pc == ESC then
    if p > PLEN then return nil end
    return p + 1
  elseif pc == LBRACK then
    if byte(pat, p) == CARET then p = p + 1 end
    repeat
      if p > PLEN then return nil end
      local cc = byte(pat, p)
      p = p + 1
      if cc == ESC and p <= PLEN then p = p + 1 end
    until byte(pat, p) == RBRACK
    return p + 1
  end
  return p
end

local function singlematch(s, p, ep)
  if s > SLEN then return false end
  local c = byte(SRC, s)
  local pc = byte(PAT, p)
  if pc == DOT then return true end
  if pc == ESC then return match_class(c, byte(PAT, p + 1)) end
  if pc == LBRACK then return matchbracketclass(c, p, ep - 1) end
  return pc == c
end

local match -- recursive

local function matchbalance(s, p)
  if p >= PLEN then fail("malformed pattern (missing arguments to '%b')") end
  if s > SLEN or byte(SRC, s) ~= byte(PAT, p) then return nil end
  local b, e = byte(PAT, p), byte(PAT, p + 1)
  local cont = 1
  local src, slen = SRC, SLEN
  s = s + 1
  while s <= slen do
    local c = byte(src, s)
    if c == e then
      cont = cont - 1
      if cont == 0 then return s + 1 end
    elseif c == b then
      cont = cont + 1
    end
    s = s + 1
  end
  return nil
end

local function max_expand(s, p, ep)
  local i = 0
  while singlematch(s + i, p, ep) do i = i + 1 end
  while i >= 0 do -- try with the most repetitions first
    local res = match(s + i, ep + 1)
    if res then return res end
    i = i - 1
  end
  return nil
end

local function min_expand(s, p, ep)
  while true do
    local res = match(s, ep + 1)
    if res then return res end
    if singlematch(s, p, ep) then
      s = s + 1
    else
      return nil
    end
  end
end

local function start_capture(s, p, what)
  local level = LEVEL
  if level >= MAXCAPTURES then fail("too many captures") end
  CAP_INIT[level + 1] = s
  CAP_LEN[level + 1] = what
  LEVEL = level + 1
  local res = match(s, p)
  if res == nil then LEVEL = LEVEL - 1 end -- undo capture
  return res
end

local function capture_to_close()
  for level = LEVEL, 1, -1 do
    if CAP_LEN[level] == CAP_UNFINISHED then return level end
  end
  fail("invalid pattern capture")
end

local function end_capture(s, p)
  local l = capture_to_close()
  CAP_LEN[l] = s - CAP_INIT[l]
  local res = match(s, p)
  if res == nil then CAP_LEN[l] = CAP_UNFINISHED end -- undo capture
  return res
end

local function match_capture(s, digit)
  local l = digit - 49 -- C: l -= '1'
  if l < 0 or l >= LEVEL or CAP_LEN[l + 1] == CAP_UNFINISHED then
    fail("invalid capture index %" .. (l + 1))
  end
  local len, init = CAP_LEN[l + 1], CAP_INIT[l + 1]
  if len < 0 then return nil end -- a position capture: C compares as size_t and fails
  if SLEN - s + 1 >= len and sub(SRC, init, init + len - 1) == sub(SRC, s, s + len - 1) then
    return s + len
  end
  return nil
end

match = function(s, p)
  if DEPTH == 0 then fail("pattern too complex") end
  DEPTH = DEPTH - 1
  local pat = PAT
  ::init::
  if p <= PLEN then
    local pc = byte(pat, p)
    if pc == LPAREN then
      if byte(pat, p + 1) == RPAREN then -- position capture
        s = start_capture(s, p + 2, CAP_POSITION)
      else
        s = start_capture(s, p + 1, CAP_UNFINISHED)
      end
      goto done
    elseif pc == RPAREN then
      s = end_capture(s, p + 1)
      goto done
    elseif pc == DOLLAR and p == PLEN then -- '$' as the last character anchors
      if s ~= SLEN + 1 then s = nil end
      goto done
    elseif pc == ESC then
      local nc = byte(pat, p + 1)
      if nc == LETTER_B then
        s = matchbalance(s, p + 2)
        if s ~= nil then
          p = p + 4
          goto init
        end
        goto done
      elseif nc == LETTER_F then
        p = p + 2
        if byte(pat, p) ~= LBRACK then fail("missing '[' after '%f' in pattern") end
        local ep = classend(p)
        local previous = s == 1 and 0 or byte(SRC, s - 1)
        local current = byte(SRC, s) or 0
        if not matchbracketclass(previous, p, ep - 1) and matchbracketclass(current, p, ep - 1) then
          p = ep
          goto init
        end
        s = nil
        goto done
      elseif nc ~= nil and nc >= DIGIT0 and nc <= DIGIT9 then
        s = match_capture(s, nc)
        if s ~= nil then
          p = p + 2
          goto init
        end
        goto done
      end
    end
    do -- default: a single-character class plus an optional suffix
      local ep = classend(p)
      local epc = byte(pat, ep)
      if not singlematch(s, p, ep) then
        if epc == STAR or epc == QUEST or epc == DASH then -- accept empty
          p = ep + 1
          goto init
        end
        s = nil -- '+' or no suffix
      elseif epc == QUEST then
        local res = match(s + 1, ep + 1)
        if res ~= nil then
          s = res
        else
          p = ep + 1
          goto init
        end
      elseif epc == PLUS then
        s = max_expand(s + 1, p, ep)
      elseif epc == STAR then
        s = max_expand(s, p, ep)
      elseif epc == DASH then
        s = min_expand(s, p, ep)
      else
        s = s + 1
        p = ep
        goto init
      end
    end
  end
  ::done::
  DEPTH = DEPTH + 1
  return s
end

local function capture(i, s, e)
  if i >= LEVEL then
    if i ~= 0 then fail("invalid capture index %" .. (i + 1)) end
    return sub(SRC, s, e - 1)
  end
  local len = CAP_LEN[i + 1]
  local init = CAP_INIT[i + 1]
  if len == CAP_UNFINISHED then fail("unfinished capture") end
  if len == CAP_POSITION then return init end
  return sub(SRC, init, init + len - 1)
end

-- C: push_captures; `whole` false means "no captures, no whole match" (find)
local function captures(s, e, whole)
  local n = LEVEL
  if n == 0 and whole then n = 1 end
  if n == 0 then return end
  if n == 1 then return capture(0, s, e) end
  local out = {}
  for i = 0, n - 1 do out[i + 1] = capture(i, s, e) end
  return unpack(out, 1, n)
end

local function posrelat(pos, len)
  if pos > 0 then return pos end
  if pos == 0 or pos < -len then return 1 end
  return len + pos + 1
end

-- The matcher's search loop (C: the loop of str_find_aux, without the plain-text
-- shortcut): the first position from `init` (an integer or nil) where p matches.
-- Returns that position and the one just after the match, or nil; the captures stay
-- in the module's slots for `capture` until the next search.
local function search(s, p, init)
  local ls = #s
  init = posrelat(init or 1, ls)
  if init > ls + 1 then return nil end
  local pstart = 1
  local anchor = byte(p, 1) == CARET
  if anchor then pstart = 2 end
  SRC, SLEN, PAT, PLEN = s, ls, p, #p
  local s1 = init
  repeat
    LEVEL, DEPTH = 0, MAXCCALLS
    local e = match(s1, pstart)
    if e ~= nil then return s1, e end
    s1 = s1 + 1
  until s1 > ls + 1 or anchor
  return nil
end

local function found(find, s1, e)
  if s1 == nil then return nil end
  if find then return s1, e - 1, captures(nil, nil, false) end
  return captures(s1, e, true)
end

-- string.find's results from the matcher alone, as gmatch and gsub match
function M.scan(s, p, init) return found(true, search(s, p, init)) end
function M.match(s, p, init) return found(false, search(s, p, init)) end

-- the search alone; then `capture(i, s1, e)` reads capture i (0-based) lazily, raising
-- exactly where the C code raises ("unfinished capture", "invalid capture index")
M.search = search
M.capture = capture
function M.levels() return LEVEL end

-- C: nospecials. string.find treats a pattern without these as plain text.
local SPECIALS = "[%^%$%*%+%?%.%(%[%%%-]"
function M.has_specials(p) return c_find(p, SPECIALS) ~= nil end

-- C: str_find_aux's plain search (lmemfind). Every step is a short C call (a memchr
-- for the first byte, a comparison of one candidate), so the hook can stop it.
function M.plain_find(s, p, init)
  local ls, lp = #s, #p
  init = posrelat(init or 1, ls)
  if init > ls + 1 then return nil end
  if lp == 0 then return init, init - 1 end
  local last_start = ls - lp + 1
  local first = sub(p, 1, 1)
  local i = init
  while i <= last_start do
    local at = c_find(s, first, i, true)
    if at == nil or at > last_start then return nil end
    if sub(s, at, at + lp - 1) == p then return at, at + lp - 1 end
    i = at + 1
  end
  return nil
end

-- string.find without `plain`: a pattern without special characters is plain text
function M.find(s, p, init)
  if not M.has_specials(p) then return M.plain_find(s, p, init) end
  return found(true, search(s, p, init))
end

---------------------------------------------------------------------------------
-- Cost analysis.
--
-- The pattern is read as a list of items the way the C matcher reads it. R(j) is
-- the most work one call of match() can do from item j on, whatever the subject;
-- F(j) the most work of a call that fails; A(j) says the call cannot fail. One unit
-- is one character test (a bracket class costs its length). With n the subject
-- length, by item kind (x' is the value for the next item):
--   capture open/close   R = c + R'            F = c + F'          A = A'
--     (c = 1 to open; closing scans the open captures, so c = 1 + their number)
--   `$` at the end       R = F = 1                                 A = false
--   %b, %1..%9           R = n + R'            F = n + F'          A = false
--   %f[set], class       R = c + R'            F = c + F'          A = false
--   class?               R = c + F' + R'       F = c + 2F'         A = A'
--   class* / class+      (n+1)c to count, then up to n+1 tries of the rest:
--                        R = (n+1)c + nF' + R' F = (n+1)(c + F')   A = A' (for *)
--   class-               R = (n+1)c + nF' + R' F = (n+1)(c + F')   A = A'
-- When the rest cannot fail (A') the first try succeeds, so a quantifier costs
-- (n+1)c + R'. When the item after a quantifier must consume a character from a set
-- disjoint from the quantified class, every try but the last fails at that first
-- character, so each costs only that test. A search tries up to n+2 start
-- positions: all but the last fail. The totals are doubled for the match() calls
-- themselves (each unit comes with at most one). Items the C matcher rejects as malformed
-- are read as "fail here", which only shortens the real work (it raises an error).
---------------------------------------------------------------------------------

local OPEN, CLOSE, ENDANCHOR, SCAN, SINGLE, FAIL = 1, 2, 3, 4, 5, 6

-- items of pattern p (without a leading anchor), as parallel arrays
local function parse(p, pstart)
  local kind, cost, suffix, first, last = {}, {}, {}, {}, {}
  local k, backref = 0, false
  local plen = #p
  local i = pstart
  PAT, PLEN = p, plen
  while i <= plen do
    local c = byte(p, i)
    k = k + 1
    if c == LPAREN then
      kind[k], cost[k] = OPEN, 1
      i = i + ((byte(p, i + 1) == RPAREN) and 2 or 1)
    elseif c == RPAREN then
      kind[k] = CLOSE -- its cost, a scan of the open captures, is set below
      i = i + 1
    elseif c == DOLLAR and i == plen then
      kind[k], cost[k] = ENDANCHOR, 1
      i = i + 1
    else
      local nc = c == ESC and byte(p, i + 1) or nil
      if nc == LETTER_B then
        if i + 3 > plen then kind[k] = FAIL break end
        kind[k], cost[k] = SCAN, 1
        i = i + 4
      elseif nc == LETTER_F then
        if byte(p, i + 2) ~= LBRACK then kind[k] = FAIL break end
        local ep = classend_or_nil(i + 2)
        if ep == nil then kind[k] = FAIL break end
        kind[k], cost[k] = SINGLE, ep - i
        suffix[k] = 0
        i = ep
      elseif nc ~= nil and nc >= DIGIT0 and nc <= DIGIT9 then
        kind[k], cost[k] = SCAN, 1
        backref = true
        i = i + 2
      else
        local ep = classend_or_nil(i)
        if ep == nil then kind[k] = FAIL break end
        local sx = byte(p, ep)
        if sx ~= STAR and sx ~= PLUS and sx ~= DASH and sx ~= QUEST then sx = 0 end
        kind[k], cost[k], suffix[k] = SINGLE, ep - i, sx
        first[k], last[k] = i, ep -- the class, for disjointness tests
        i = ep + ((sx ~= 0) and 1 or 0)
      end
    end
  end
  -- The C matcher can raise only if an item is malformed, captures do not pair up, the
  -- pattern refers back to a capture, has too many captures, or is long enough to
  -- reach the recursion limit.
  local opens, depth, balanced = 0, 0, true
  local may_raise = backref or k >= MAXCCALLS / 2
  for j = 1, k do
    local kd = kind[j]
    if kd == OPEN then
      opens, depth = opens + 1, depth + 1
    elseif kd == CLOSE then
      depth = depth - 1
      if depth < 0 then balanced = false end
    elseif kd == FAIL then
      may_raise = true
    end
  end
  if depth ~= 0 then balanced = false end
  if not balanced or opens > MAXCAPTURES then may_raise = true end
  for j = 1, k do
    if kind[j] == CLOSE then cost[j] = 1 + (opens < MAXCAPTURES and opens or MAXCAPTURES) end
  end
  -- dot[j]: item j is the class '.'
  local dot = {}
  for j = 1, k do
    dot[j] = kind[j] == SINGLE and cost[j] == 1 and byte(p, first[j] or 0) == DOT
  end
  return { kind = kind, cost = cost, suffix = suffix, first = first, last = last, k = k,
    pattern = p, disjoint = {}, dot = dot, balanced = balanced, may_raise = may_raise,
    opens = opens }
end

-- does the class at [p1, e1) share no byte with the class at [p2, e2) of `pattern`?
local function classes_disjoint(pattern, p1, e1, p2, e2)
  PAT, PLEN = pattern, #pattern
  local disjoint = true
  for c = 0, 255 do
    SRC, SLEN = char(c), 1
    if singlematch(1, p1, e1) and singlematch(1, p2, e2) then
      disjoint = false
      break
    end
  end
  SRC, SLEN = "", 0
  return disjoint
end

-- If a quantified item j is followed (past captures) by a mandatory single class,
-- returns the cost of reaching and failing that class, when its set is disjoint
-- from item j's; else nil.
local function disjoint_stop(info, j)
  local cached = info.disjoint[j]
  if cached ~= nil then return cached or nil end
  local kind, cost, suffix = info.kind, info.cost, info.suffix
  local through = 0
  local m = j + 1
  while m <= info.k and (kind[m] == OPEN or kind[m] == CLOSE) do
    through = through + cost[m]
    m = m + 1
  end
  local result = false
  if m <= info.k and kind[m] == SINGLE and info.first[m] ~= nil
      and (suffix[m] == 0 or suffix[m] == PLUS)
      and classes_disjoint(info.pattern, info.first[j], info.last[j], info.first[m], info.last[m]) then
    result = through + cost[m]
  end
  info.disjoint[j] = result
  return result or nil
end

-- Worst-case work of one match() call at the first item (R) and of one that fails
-- (F), for a subject of n bytes.
local function attempt_cost(info, n, refine)
  local kind, cost, suffix = info.kind, info.cost, info.suffix
  -- E: the rest matches the empty string at the end of the subject (it holds only
  -- captures, optional items and a final '$')
  local R, F, A, E = 1, 0, true, true
  for j = info.k, 1, -1 do
    local kd, c = kind[j], cost[j]
    if kd == OPEN or kd == CLOSE then
      R, F = c + R, c + F
    elseif kd == ENDANCHOR then
      R, F, A, E = 1, 1, false, true
    elseif kd == FAIL then
      R, F, A, E = 1, 1, false, false
    elseif kd == SCAN then
      R, F, A, E = n + R, n + F, false, false
    else
      local sx = suffix[j]
      if sx == 0 then
        R, F, A, E = c + R, c + F, false, false
      elseif sx == QUEST then
        if A then
          R = c + R
        else
          R, F = c + F + R, c + 2 * F
        end
      elseif (sx == STAR or sx == DASH) and E and info.dot[j] then
        -- '.*' or '.-' before a rest that matches empty at the end: '.' takes every
        -- byte, so a try reaches the end and succeeds there. '.*' tries the end
        -- first; '.-' tries each position on the way.
        if sx == STAR then
          R = (n + 2) * c + R
        else
          R = c + (n + 1) * (c + F) + R
        end
        F, A = 0, true
      else
        -- (each form also tests the class once before it looks at the suffix: + c)
        local stop = (not A) and refine and disjoint_stop(info, j) or nil
        if sx == DASH then
          if A then
            R = c + 1 + R
          elseif stop then
            R, F = c + (n + 1) * (c + stop) + R, c + (n + 1) * (c + stop) + F
          else
            R, F = c + (n + 1) * c + n * F + R, c + (n + 1) * (c + F)
          end
        else -- '*' or '+'
          local count = (n + 2) * c
          if A then
            R = count + R
            if sx == PLUS then F, A = c, false end
          elseif stop then
            R, F = count + n * stop + R, count + n * stop + F
          else
            R, F = count + n * F + R, count + (n + 1) * F
          end
        end
      end
    end
    if R > 1e300 then return huge, huge end
    if not (kd == OPEN or kd == CLOSE or kd == ENDANCHOR) and (kd ~= SINGLE or suffix[j] == 0
        or suffix[j] == PLUS) then
      E = false
    end
  end
  if A then F = 0 end
  -- every unit above comes with at most one match() call of its own: count those too
  return 2 * R, 2 * F
end

-- Patterns analysed recently. Bounded: the table lives in the script's memory.
local analysed, analysed_count = {}, 0

local function analyse(p)
  local info = analysed[p]
  if info ~= nil then return info end
  local anchor = byte(p, 1) == CARET
  info = parse(p, anchor and 2 or 1)
  info.anchor = anchor
  -- a quick bound first: every quantifier, %b and back reference multiplies the work
  -- by at most n+1, every '?' by 2 (see attempt_cost)
  local q, o = 0, 0
  for j = 1, info.k do
    local kd, sx = info.kind[j], info.suffix[j]
    if kd == SCAN or (kd == SINGLE and (sx == STAR or sx == PLUS or sx == DASH)) then
      q = q + 1
    elseif kd == SINGLE and sx == QUEST then
      o = o + 1
    end
  end
  local total = 0
  for j = 1, info.k do total = total + (info.cost[j] or 1) end
  info.q, info.o, info.total = q, o, total
  if analysed_count >= 64 then
    analysed, analysed_count = {}, 0
  end
  analysed[p] = info
  analysed_count = analysed_count + 1
  return info
end

-- Per-attempt costs of pattern p on a subject of n bytes: F (an attempt that fails)
-- and R (any attempt), such that a search trying `starts` positions does at most
-- (starts - 1) * F + R work. Starts at the quick bound (every quantifier, %b and back
-- reference multiplies the work by at most n+1, every '?' by 2) and refines only
-- while the search's bound is above `limit`. Also returns whether p is anchored.
function M.costs(p, n, starts, limit)
  local info = analyse(p)
  if info.anchor then starts = 1 end
  local quick = (n + 1) ^ info.q * 2 ^ info.o * (info.total + 1)
  if starts * quick <= limit then return quick, quick, info.anchor end
  local R, F = attempt_cost(info, n, false)
  if (starts - 1) * F + R > limit then R, F = attempt_cost(info, n, true) end
  return F, R, info.anchor
end

-- what the strings wrappers need to know about p besides its cost
function M.shape(p)
  local info = analyse(p)
  return info.balanced, info.may_raise, info.opens
end

return M
