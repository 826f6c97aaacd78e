"""Harness for comparing the sandbox's string functions with Lua's own C functions.

`Parity(limit)` loads patterns.lua and strings.lua into a bare Lua state (no sandbox,
no budget) with `limit` as the most work a C pattern call may do: 0 sends every call
to the Lua matcher, a small limit mixes C and Lua steps, the default keeps C where
the bound allows. `compare(op, s, p, extra)` runs the original C function and the
replacement on the same arguments and returns None if they agree (same results, or
errors with the same message apart from the line that raised), else a description.
"""

from __future__ import annotations

import random
from importlib import resources
from typing import Any

from lupa import lua54

_COMPARE = rb"""
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
"""

SUBJECT_BYTES = b"aab:()[]%x \x00A1-"
PATTERN_ATOMS = [
    b"a", b"b", b".", b"%a", b"%d", b"%s", b"%w", b"%A", b"[ab]", b"[^a]", b"[%a-]", b"[]]",
    b"(", b")", b"()", b"%b()", b"%f[a]", b"%f[%W]", b"%1", b"%2", b"$", b"^", b":", b"%",
    b"[", b"\x00", b"-", b"x",
]  # fmt: skip
SUFFIXES = [b"", b"", b"", b"*", b"+", b"-", b"?"]
REPLACEMENTS: list[Any] = [b"<%0>", b"%1-%1", b"%%", b"%2", b"x%", b"%z", b"", 1, 2, 42]


def _source(name: str) -> bytes:
    return resources.files("fila.lua").joinpath(f"{name}.lua").read_bytes()


class Parity:
    def __init__(self, limit: float | None) -> None:
        runtime = lua54.LuaRuntime(encoding=None, unpack_returned_tuples=True)
        self._compare = runtime.execute(
            _COMPARE,
            runtime.compile(_source("patterns"), name=b"=fila.patterns"),
            runtime.compile(_source("strings"), name=b"=fila.strings"),
            limit,
        )

    def compare(self, op: str, s: bytes, p: bytes, init: int | None, *extra: Any) -> str | None:
        why = self._compare(op.encode(), s, p, init, *extra)
        return None if why is None else why.decode("utf-8", "replace")


def random_case(rnd: random.Random) -> tuple[str, bytes, bytes, int | None, Any, int | None]:
    op = rnd.choice(["find", "match", "gmatch", "gsub", "plain"])
    s = bytes(rnd.choice(SUBJECT_BYTES) for _ in range(rnd.randint(0, 14)))
    if rnd.random() < 0.2:
        s = b"a" * rnd.randint(0, 40) + s
    atoms = []
    for _ in range(rnd.randint(0, 5)):
        atom = rnd.choice(PATTERN_ATOMS)
        atoms.append(atom + (rnd.choice(SUFFIXES) if rnd.random() < 0.5 else b""))
    p = b"".join(atoms)
    init = rnd.choice([None, None, 1, 2, 0, -1, -4, 7, 40])
    repl = rnd.choice(REPLACEMENTS)
    n = rnd.choice([None, None, 0, 1, 2])
    return op, s, p, init, repl, n
