-- Test harness (see lua_parity.py): runs a C string function and its sandbox
-- replacement on the same arguments and describes any difference.
local patterns_chunk, strings_chunk, limit = ...
local C = { find = string.find, match = string.match, gmatch = string.gmatch, gsub = string.gsub }
local S = strings_chunk(patterns_chunk(), function() end, load, limit).string

-- without the line that raised, and with the function name as a call site names it
-- (C names it after the global when pcall calls it directly)
local function strip(e)
  if type(e) ~= "string" then return e end
  e = C.gsub(e, "^[^:]*:%d+: ", "")
  return (C.gsub(e, "to 'string%.", "to '"))
end

local function collect(f, ...)
  local r = table.pack(pcall(f, ...))
  if not r[1] then return { ok = false, err = strip(r[2]) } end
  return { ok = true, n = r.n - 1, table.unpack(r, 2, r.n) }
end

local function iterate(gmatch, s, p, init)
  local out = {}
  local it = gmatch(s, p, init)
  for _ = 1, 300 do
    local r = table.pack(it())
    if r[1] == nil then break end
    out[#out + 1] = r
  end
  return out
end

local function same(a, b)
  if a.ok ~= b.ok then return false, "ok: " .. tostring(a.ok) .. " vs " .. tostring(b.ok)
    .. " (" .. tostring(a.err or a[1]) .. " / " .. tostring(b.err or b[1]) .. ")" end
  if not a.ok then
    if a.err ~= b.err then return false, "error: " .. tostring(a.err) .. " vs " .. tostring(b.err) end
    return true
  end
  if a.n ~= b.n then return false, "count " .. a.n .. " vs " .. b.n end
  for i = 1, a.n do
    local x, y = a[i], b[i]
    if type(x) == "table" then
      if type(y) ~= "table" or #x ~= #y then return false, "iterations differ" end
      for j = 1, #x do
        if x[j].n ~= y[j].n then return false, "iteration " .. j .. " count" end
        for k = 1, x[j].n do
          if x[j][k] ~= y[j][k] or math.type(x[j][k]) ~= math.type(y[j][k]) then
            return false, "iteration " .. j .. " value " .. k .. ": " .. tostring(x[j][k]) .. " vs " .. tostring(y[j][k])
          end
        end
      end
    elseif x ~= y or math.type(x) ~= math.type(y) then
      return false, "value " .. i .. ": " .. tostring(x) .. " vs " .. tostring(y)
    end
  end
  return true
end

local calls = 0
local replacements = {
  function(...) calls = calls + 1; if calls % 3 == 0 then return nil end; return table.concat({ ... }, "|") end,
  { a = "A", b = false, ["("] = 7, x = "%" },
}

return function(op, s, p, init, repl_kind, n)
  local a, b
  if op == "gmatch" then
    a = collect(iterate, C.gmatch, s, p, init)
    b = collect(iterate, S.gmatch, s, p, init)
  elseif op == "gsub" then
    local repl = repl_kind
    if repl_kind == 1 or repl_kind == 2 then repl = replacements[repl_kind] end
    calls = 0
    a = collect(C.gsub, s, p, repl, n)
    calls = 0
    b = collect(S.gsub, s, p, repl, n)
  elseif op == "plain" then
    a = collect(C.find, s, p, init, true)
    b = collect(S.find, s, p, init, true)
  else
    a = collect(C[op], s, p, init)
    b = collect(S[op], s, p, init)
  end
  local ok, why = same(a, b)
  if ok then return nil end
  return why
end
