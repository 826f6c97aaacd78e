"""The creation-time check of hook scripts (`fila.lua.static_check`), in process: what
it refuses (calls and indexing of what the sandbox lacks) and the working scripts it
must let through. Its wiring (CreateQueue answers INVALID_ARGUMENT) is in
tests/test_lua_sandbox.py's BAD_SCRIPTS, and UpdateQueue's in tests/test_queue_config.py.
"""

from __future__ import annotations

import pytest

from fila.lua.sandbox import LuaSandbox, ScriptError
from fila.lua.static_check import check_globals

ENVIRONMENT = LuaSandbox(
    queue="q", timeout_ms=10, memory_limit_bytes=10**7, config_get=lambda key: None
).environment()

REFUSED = {
    'function on_enqueue(m) os.execute("rm -rf /") end': "os.execute",
    "function on_enqueue(m) return { string.dump(on_enqueue) } end": "string.dump",
    'local json = require("json") function on_enqueue(m) return {} end': "require",
    'function on_failure(m) io.write("x") return { action = "dlq" } end': "io.write",
    'function on_enqueue(m) return { fairness_key = fila.set("k") } end': "fila.set",
    "function on_enqueue(m) return helper(m) end": "helper",
    "function on_enqueue(m) debug.traceback() end": "debug.traceback",
    'function on_enqueue(m) local f = load "return 1" end': "load",
    "function on_enqueue(m) return os:time() end": "os:time",
}

ACCEPTED = [
    "local os = { execute = function() end }\nfunction on_enqueue(m) os.execute() end",
    'function on_enqueue(m)\n  -- os.execute("x")\n  local t = "os.execute(1)" return {} end',
    "function on_enqueue(m) local x = [==[ io.write() ]==] --[[ require('x') ]] return {} end",
    "--[[ a comment over lines:\n os.execute() ]] function on_enqueue(m) return {} end",
    "helper = function(x) return x end\nfunction on_enqueue(m) return helper(m) end",
    "function on_enqueue(m) return helper(m) end\nfunction helper(m) return {} end",
    "function on_enqueue(msg) return { fairness_key = msg.headers.tenant:lower() } end",
    "function on_enqueue(m) for k, v in pairs(m.headers) do print(k, v) end return {} end",
    "function on_enqueue(m) return { weight = math.floor(2.5), fairness_key = ('x'):rep(2) } end",
    "local function f(a, b) return a(b) end function on_enqueue(m) return f(tostring, 1) end",
    "function on_enqueue(m) local t = {} t.io = 1 return { fairness_key = utf8.char(72) } end",
    "function on_enqueue(m) local v = fila.get('k') return { fairness_key = v or 'd' } end",
    "function on_enqueue(m) ::top:: return setmetatable({}, { __index = table }) end",
]


@pytest.mark.parametrize("source", sorted(REFUSED))
def test_a_call_of_what_the_sandbox_lacks_is_refused_by_name(source: str) -> None:
    with pytest.raises(ScriptError, match=f"uses {REFUSED[source]}, which the sandbox"):
        check_globals(source, ENVIRONMENT)


@pytest.mark.parametrize("source", ACCEPTED)
def test_scripts_that_define_what_they_use_pass(source: str) -> None:
    check_globals(source, ENVIRONMENT)


def test_the_environment_is_the_sandboxes_own() -> None:
    assert {"string", "table", "math", "utf8", "fila", "pcall", "print"} <= ENVIRONMENT.keys()
    assert not {"os", "io", "require", "load", "debug", "package"} & ENVIRONMENT.keys()
    assert "dump" not in ENVIRONMENT["string"] and ENVIRONMENT["fila"] == {"get"}
