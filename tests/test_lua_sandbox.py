"""The Lua sandbox against hostile and broken scripts, end to end through gRPC.

A hostile `on_enqueue` must cost at most its budget: the enqueue still succeeds with
the default decision, the broker stays up, other queues keep their latency and the
broker's memory stays flat. Broken scripts are refused at CreateQueue; garbage
results fall back to defaults. (The circuit breaker, which bypasses a failing hook for
its cooldown, is specified on a manual clock in tests/core/test_policy.py.)

Most tests share one broker whose circuit breaker is effectively off
(threshold 1,000,000), so every hostile call really runs the script. The in-process
tests at the end check what a server test cannot see cheaply: that the Lua pattern
matcher and the wrappers agree with Lua's C functions on many random inputs, that
the budget charges only the calling thread, and that no script outcome makes a hook
raise.
"""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from lua_parity import Parity, random_case
from lupa import lua54
from support import ServerFactory, unique, wait_until
from support.stubs import Fila, connect, rpc_error
from support.timing import TimedConsumer, rss_bytes, thread_sched

from fila.lua.hooks import (
    DEFAULT_ENQUEUE,
    DEFAULT_FAILURE,
    FailureLog,
    LuaLimits,
    QueueHooks,
)
from fila.lua.sandbox import BUDGET_EXHAUSTED, LuaSandbox, ScriptError
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, messages_pb2, service_pb2

T = 10.0
# Event-loop CPU one hostile enqueue may cost: the 10 ms budget plus request handling.
# Measured as the loop thread's CPU time, so a busy host does not change it.
HOSTILE_LOOP_CPU_LIMIT_S = 0.06
# A call that has not answered by then is hung (its budget is 10 ms of CPU).
HANG_DEADLINE_S = 2.0

NO_BREAKER = "[lua]\ncircuit_breaker_threshold = 1000000\n"


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("hostile")
    proc = ServerProcess(root / "data", config_toml=NO_BREAKER)
    proc.start()
    try:
        yield proc
    finally:
        if proc.running:
            proc.stop()


def script(body: str, ret: str = '{ fairness_key = "escaped" }') -> str:
    return f"function on_enqueue(m)\n{body}\nreturn {ret}\nend\n"


def broker_answers(fila: Fila, timeout: float = 1.0) -> bool:
    try:
        fila.admin.ListQueues(admin_pb2.ListQueuesRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return True


def fail_if_hung(server: ServerProcess, fila: Fila, what: str, exc: grpc.RpcError) -> None:
    """A hostile call timed out: if the broker stopped answering, kill and restart it
    (so the other tests keep a working broker) and fail naming the script."""
    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        raise exc
    hung = not broker_answers(fila)
    if hung and server.running:
        server.kill()
        server.start()
    pytest.fail(
        f"{what}: the call did not answer within {HANG_DEADLINE_S}s"
        + (
            "; the broker stopped answering every RPC (event loop blocked) and was killed"
            if hung
            else ""
        )
    )


def timed_enqueue(
    server: ServerProcess, fila: Fila, queue: str, headers: dict[str, str], what: str
) -> tuple[str, float]:
    """Enqueues one message; returns its id and the event-loop CPU time it cost."""
    cpu_before, _ = thread_sched(server.pid)
    try:
        reply = fila.svc.Enqueue(
            service_pb2.EnqueueRequest(queue=queue, headers=headers, payload=b"p"),
            timeout=HANG_DEADLINE_S,
        )
    except grpc.RpcError as exc:
        fail_if_hung(server, fila, what, exc)
        raise
    cpu_after, _ = thread_sched(server.pid)
    return reply.message_id, cpu_after - cpu_before


def drain(fila: Fila, queue: str, count: int) -> dict[str, messages_pb2.Message]:
    with TimedConsumer(fila.channel, queue, auto_ack=True) as consumer:
        return {m.id: m for m in consumer.take(count, T)}


def assert_default(message: messages_pb2.Message, what: str) -> None:
    meta = message.metadata
    assert (meta.fairness_key, meta.weight, list(meta.throttle_keys)) == ("default", 1, []), (
        f"{what}: got fairness_key={meta.fairness_key!r} weight={meta.weight} "
        f"throttle_keys={list(meta.throttle_keys)}, expected the defaults"
    )


PWNED = Path(f"/tmp/fila-sandbox-escape-{uuid.uuid4().hex}")

# Each body is followed by `return { fairness_key = "escaped" }`: reaching it means
# the hostile operation neither ran away nor was refused.
HOSTILE = {
    "infinite_loop": script("while true do end"),
    "pcall_infinite_loop": script("pcall(function() while true do end end)"),
    "xpcall_infinite_loop": script(
        "xpcall(function() while true do end end, function() while true do end end)"
    ),
    "nested_pcall_loop": script(
        "for i = 1, 1e12 do pcall(function() pcall(function() while true do end end) end) end"
    ),
    "memory_bomb": script('local s = string.rep("x", 2^30)'),
    "concat_bomb": script('local s = "x" while true do s = s .. s end'),
    "deep_recursion": script("local function f(n) return 1 + f(n + 1) end f(1)"),
    "deep_c_recursion": script(
        "local t = setmetatable({}, {})"
        ' getmetatable(t).__index = function(s, k) return s[k .. "x"] end'
        " local _ = t.a"
    ),
    "huge_table": script("local t = {} for i = 1, 1e9 do t[i] = i end"),
    # Parenthesised: CreateQueue refuses the plain forms (BAD_SCRIPTS below), and these
    # prove that the sandbox itself holds when a script gets past that check.
    "os_execute": script(f'(os).execute("touch {PWNED}")'),
    "io_open": script(f'(io).open("{PWNED}", "w"):write("x")'),
    "require": script(f'local os2 = (require)("os") os2.execute("touch {PWNED}")'),
    "load": script('(load)("return 1")()'),
    "loadstring": script('(loadstring)("return 1")()'),
    "dofile": script('(dofile)("/etc/passwd")'),
    "string_dump": script("(string).dump(on_enqueue)"),
    "debug_sethook": script("(debug).sethook()"),
    "package_loaded": script('(package).loaded.os.execute("true")'),
    "python_bridge": script('(python).eval("1")'),
    "fila_get_attribute": script("local c = fila.get.__class__"),
    "coroutine": script("(coroutine).wrap(function() while true do end end)()"),
    "collectgarbage": script('(collectgarbage)("stop")'),
    "pathological_pattern": script('string.rep("a", 20000):find(".-.-.-b")'),
    "pathological_gsub": script('string.rep("a", 20000):gsub(".-.-.-b", "")'),
    "gc_finalizer_loop": script(
        "setmetatable({}, { __gc = function() while true do end end })"
        " for i = 1, 1e5 do local t = { i } end"
    ),
    # a plain find is a C loop the instruction hook cannot interrupt (O(n*m) memcmp)
    "plain_find_quadratic": script(
        'local needle = string.rep("a", 100000) .. "b"'
        ' local hay = string.rep("a", 400000)'
        " hay:find(needle, 1, true)"
    ),
    # `?` is a backtracking quantifier too: a?^n a^n against a^n is 2^n steps
    "optional_quantifier_pattern": script(
        'string.find(string.rep("a", 40), string.rep("a?", 40) .. string.rep("a", 40))'
    ),
    # C string.rep would loop 1e18 times copying nothing; returning {} here is fine
    "rep_empty_string": script('local s = string.rep("", 1e18)', ret="{}"),
    # the broker reads the result table after the script returns: metamethods there
    # must not run outside the budget
    "result_index_metamethod": script(
        "", ret="setmetatable({}, { __index = function() while true do end end })"
    ),
    "result_throttle_keys_len": script(
        "", ret="{ throttle_keys = setmetatable({}, { __len = function() while true do end end }) }"
    ),
    "error_object_tostring": script(
        "error(setmetatable({}, { __tostring = function() while true do end end }))"
    ),
}

POISONED_STRING_METATABLE = script(
    'getmetatable("").__index = function() while true do end end',
    ret='{ throttle_keys = { "k" } }',
)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_on_enqueue_falls_back(hostile_server: ServerProcess, case: str) -> None:
    server = hostile_server
    with connect(server.addr) as fila:
        queue = unique(case.replace("_", "-"))
        fila.create_queue(queue, on_enqueue=HOSTILE[case])
        ids = []
        for i in range(3):
            mid, cpu = timed_enqueue(server, fila, queue, {"i": str(i)}, case)
            ids.append(mid)
            assert cpu < HOSTILE_LOOP_CPU_LIMIT_S, (
                f"{case}: one enqueue kept the broker's event loop busy for {cpu * 1000:.0f} ms "
                "of CPU; the hook budget is 10 ms and every other RPC waited meanwhile"
            )
        assert server.running and broker_answers(fila), f"{case}: broker down"
        messages = drain(fila, queue, 3)
        assert sorted(messages) == sorted(ids)
        for message in messages.values():
            assert_default(message, case)
        assert not PWNED.exists(), f"{case}: the script reached the file system"


def test_poisoned_string_metatable_is_never_called_by_the_broker(
    hostile_server: ServerProcess,
) -> None:
    """The script's result is valid, so it is used; reading it must not call the
    poisoned string methods (that would loop with no budget and hang the broker)."""
    server = hostile_server
    with connect(server.addr) as fila:
        queue = unique("poisoned")
        fila.create_queue(queue, on_enqueue=POISONED_STRING_METATABLE)
        ids = [timed_enqueue(server, fila, queue, {"i": str(i)}, "poisoned")[0] for i in range(3)]
        assert server.running and broker_answers(fila), "poisoned: broker down"
        messages = drain(fila, queue, 3)
        assert sorted(messages) == sorted(ids)
        for message in messages.values():
            assert list(message.metadata.throttle_keys) == ["k"]


def test_hostile_on_failure_result_metamethod(hostile_server: ServerProcess) -> None:
    """The same post-processing hazard on the failure path: a nack must not hang."""
    server = hostile_server
    on_failure = (
        "function on_failure(m)\n"
        "  return setmetatable({}, { __index = function() while true do end end })\n"
        "end\n"
    )
    with connect(server.addr) as fila:
        queue = unique("onfail-meta")
        fila.create_queue(queue, on_failure=on_failure)
        mid = fila.enqueue(queue, b"x")
        with TimedConsumer(fila.channel, queue) as consumer:
            consumer.get(T)
            cpu_before, _ = thread_sched(server.pid)
            try:
                fila.svc.Nack(
                    service_pb2.NackRequest(queue=queue, message_id=mid, error="e"),
                    timeout=HANG_DEADLINE_S,
                )
            except grpc.RpcError as exc:
                fail_if_hung(server, fila, "on_failure returning a table with __index", exc)
            assert thread_sched(server.pid)[0] - cpu_before < HOSTILE_LOOP_CPU_LIMIT_S
            # fallback for on_failure is an immediate retry
            _, again = consumer.get(T)
            assert again.id == mid and again.metadata.attempt_count == 1
            fila.ack(queue, mid)


RECOVERING = """
function on_enqueue(m)
  local mode = m.headers.mode
  if mode == "loop" then while true do end end
  if mode == "pcall" then pcall(function() while true do end end) end
  if mode == "memory" then local s = string.rep("x", 2^30) end
  if mode == "table" then big = {} for i = 1, 1e9 do big[i] = i end end
  if mode == "recursion" then local function f() return 1 + f() end f() end
  if mode == "error" then error("plain error") end
  return { fairness_key = "good-" .. (m.headers.n or "?") }
end
"""


def test_state_recovers_after_each_hostile_call(hostile_server: ServerProcess) -> None:
    """A failed call must not poison the queue's Lua state for the next one."""
    server = hostile_server
    with connect(server.addr) as fila:
        queue = unique("recover")
        fila.create_queue(queue, on_enqueue=RECOVERING)
        expected: dict[str, str] = {}
        for n, mode in enumerate(["loop", "pcall", "memory", "table", "recursion", "error"] * 2):
            bad, _ = timed_enqueue(server, fila, queue, {"mode": mode}, mode)
            good, cpu = timed_enqueue(server, fila, queue, {"n": str(n)}, f"good after {mode}")
            expected[bad] = "default"
            expected[good] = f"good-{n}"
            assert cpu < HOSTILE_LOOP_CPU_LIMIT_S
        got = {mid: m.metadata.fairness_key for mid, m in drain(fila, queue, len(expected)).items()}
        assert got == expected


def _hammer(
    addr: str, queue: str, stop: threading.Event, done: list[str], errors: list[str]
) -> None:
    with connect(addr) as fila:
        while not stop.is_set():
            try:
                fila.svc.Enqueue(service_pb2.EnqueueRequest(queue=queue, payload=b"h"), timeout=T)
                done.append(queue)
            except grpc.RpcError as exc:
                errors.append(str(exc.code()))
                return


def test_healthy_queue_latency_under_hostile_load(hostile_server: ServerProcess) -> None:
    """One client hammers a queue whose hook loops forever, another one whose hook
    allocates a GiB; meanwhile enqueues to a healthy queue keep their latency.

    The broker's loop runs one hook at a time, so a healthy enqueue may wait for about
    one hostile call (10 ms budget). Each healthy enqueue is measured twice: in wall
    time, and in event-loop CPU time spent between send and answer (what it waited
    behind, immune to how loaded the host is). p99 must stay under 100 ms wall (when
    the host is not oversubscribed: the loop thread waited for a CPU under 20% of the
    time) and under 40 ms of loop CPU (always).
    """
    server = hostile_server
    with connect(server.addr) as fila:
        loop_q, mem_q = unique("hammer-loop"), unique("hammer-mem")
        fila.create_queue(loop_q, on_enqueue=script("while true do end"))
        fila.create_queue(mem_q, on_enqueue=script('local s = string.rep("x", 2^30)'))
        healthy = unique("healthy")
        fila.create_queue(
            healthy, on_enqueue='function on_enqueue(m) return { fairness_key = "ok" } end'
        )
        stop = threading.Event()
        done: list[str] = []
        errors: list[str] = []
        threads = [
            threading.Thread(target=_hammer, args=(server.addr, q, stop, done, errors), daemon=True)
            for q in (loop_q, mem_q)
        ]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: done.count(loop_q) >= 5, T, what="hostile load started")
            hostile_before = len(done)
            run_before, wait_before = thread_sched(server.pid)
            wall: list[float] = []
            loop_cpu: list[float] = []
            for _ in range(200):
                cpu0 = thread_sched(server.pid)[0]
                began = time.perf_counter()
                fila.svc.Enqueue(
                    service_pb2.EnqueueRequest(queue=healthy, payload=b"ok"), timeout=T
                )
                wall.append(time.perf_counter() - began)
                loop_cpu.append(thread_sched(server.pid)[0] - cpu0)
            run_after, wait_after = thread_sched(server.pid)
            hostile = done[hostile_before:]
        finally:
            stop.set()
            for thread in threads:
                thread.join(T)
        assert not errors, errors
        loop_calls = hostile.count(loop_q)
        assert loop_calls >= 30, f"only {loop_calls} looping hook calls ran alongside"
        assert hostile.count(mem_q) >= 30

        run, wait = run_after - run_before, wait_after - wait_before
        per_loop_call = run / loop_calls  # the looping calls dominate the loop's CPU
        assert per_loop_call < 0.020, (
            f"{per_loop_call * 1000:.1f} ms of loop CPU per looping hook call (budget 10 ms)"
        )

        def p99(values: list[float]) -> float:
            return sorted(values)[int(len(values) * 0.99) - 1]

        wait_share = wait / (run + wait) if run + wait > 0 else 0.0
        summary = (
            f"wall p99 {p99(wall) * 1000:.1f} ms, median {statistics.median(wall) * 1000:.1f} ms; "
            f"loop-CPU p99 {p99(loop_cpu) * 1000:.1f} ms; the broker loop waited for a CPU "
            f"{wait_share:.0%} of the time"
        )
        # CPU time, which the budget is about; wall-clock latency depends on the machine
        # and is only reported (fila-bench measures latency).
        assert p99(loop_cpu) < 0.040, f"healthy enqueues waited behind hostile hooks: {summary}"
        assert server.running and broker_answers(fila)


RSS_MIX = [
    "infinite_loop",
    "memory_bomb",
    "concat_bomb",
    "deep_recursion",
    "huge_table",
    "pathological_pattern",
    "gc_finalizer_loop",
    "load",
]


def test_rss_stays_flat_over_hostile_calls(hostile_server: ServerProcess) -> None:
    server = hostile_server
    with connect(server.addr) as fila:
        queues = []
        for case in RSS_MIX:
            name = unique("rss-" + case.replace("_", "-"))
            fila.create_queue(name, on_enqueue=HOSTILE[case])
            queues.append(name)

        def burst(calls: int) -> None:
            futures = []
            for i in range(calls):
                request = service_pb2.EnqueueRequest(queue=queues[i % len(queues)], payload=b"r")
                futures.append(fila.svc.Enqueue.future(request, timeout=T))
                if len(futures) >= 8:
                    for f in futures:
                        f.result()
                    futures.clear()
            for f in futures:
                f.result()

        burst(40)  # warm-up: every state allocated once
        before = rss_bytes(server.pid)
        burst(200)
        after = rss_bytes(server.pid)
        assert server.running and broker_answers(fila)
        growth = (after - before) / 2**20
        assert growth < 50, f"broker RSS grew {growth:.1f} MiB over 200 hostile calls"


def _bytecode() -> str:
    raw = lua54.LuaRuntime(encoding=None).eval(
        'string.dump(load("function on_enqueue(m) return {} end"))'
    )
    assert isinstance(raw, bytes) and raw.startswith(b"\x1bLua")
    return raw.decode("latin-1")  # the wire field is a string; the header survives


BAD_SCRIPTS = {
    "does_not_compile": ("function on_enqueue(m) return {", ""),
    "lacks_on_enqueue": ("function something_else(m) return {} end", ""),
    "on_enqueue_not_a_function": ("on_enqueue = 5", ""),
    "errors_at_top_level": ('error("refused") function on_enqueue(m) return {} end', ""),
    "loops_at_top_level": ("while true do end function on_enqueue(m) return {} end", ""),
    "uses_os_at_top_level": ("(os).exit(1) function on_enqueue(m) return {} end", ""),
    # the creation-time check (fila.lua.static_check): calls of what the sandbox lacks
    "calls_os_execute": ('function on_enqueue(m) os.execute("true") return {} end', ""),
    "calls_string_dump": ("function on_enqueue(m) return { string.dump(m) } end", ""),
    "calls_require": ('local json = require("json") function on_enqueue(m) return {} end', ""),
    "on_failure_calls_io": ("", "function on_failure(m) io.write(m.error) return {} end"),
    "calls_an_undefined_helper": ("function on_enqueue(m) return helper(m) end", ""),
    "precompiled_bytecode": (_bytecode(), ""),
    "bytecode_header_only": ("\x1bLua" + "function on_enqueue(m) return {} end", ""),
    "on_failure_does_not_compile": ("", "function on_failure(m) return"),
    "on_failure_lacks_hook": ("", "function on_enqueue(m) return {} end"),
    "on_enqueue_script_defines_only_on_failure": ("function on_failure(m) return {} end", ""),
}


@pytest.mark.parametrize("case", sorted(BAD_SCRIPTS))
def test_bad_script_refused_at_create_queue(hostile_server: ServerProcess, case: str) -> None:
    on_enqueue, on_failure = BAD_SCRIPTS[case]
    with connect(hostile_server.addr) as fila:
        name = unique("bad-" + case.replace("_", "-"))
        config = admin_pb2.QueueConfig(on_enqueue_script=on_enqueue, on_failure_script=on_failure)
        cpu_before, _ = thread_sched(hostile_server.pid)
        err = rpc_error(
            fila.admin.CreateQueue, admin_pb2.CreateQueueRequest(name=name, config=config)
        )
        assert thread_sched(hostile_server.pid)[0] - cpu_before < HOSTILE_LOOP_CPU_LIMIT_S
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err)
        assert name in (err.details() or ""), err.details()
        assert "<python>" not in (err.details() or ""), err.details()
        names = set(fila.queue_names())
        assert name not in names and name + ".dlq" not in names
        # nothing half-created: the name is still free
        fila.create_queue(name, on_enqueue="function on_enqueue(m) return {} end")
        assert {name, name + ".dlq"} <= set(fila.queue_names())


SHAPES = """
function on_enqueue(m)
  local s = m.headers.shape
  if s == "string" then return "tenant-a" end
  if s == "nothing" then return end
  if s == "number" then return 42 end
  if s == "weight_zero" then return { weight = 0 } end
  if s == "weight_negative" then return { weight = -1 } end
  if s == "weight_string" then return { weight = "x" } end
  if s == "weight_fraction" then return { weight = 1.5 } end
  if s == "weight_huge" then return { weight = 2^40 } end
  if s == "throttle_string" then return { throttle_keys = "t" } end
  if s == "throttle_numbers" then return { throttle_keys = { 1, 2 } } end
  if s == "throttle_empty_string" then return { throttle_keys = { "" } } end
  if s == "key_number" then return { fairness_key = 5 } end
  if s == "key_empty" then return { fairness_key = "" } end
  if s == "key_table" then return { fairness_key = {} } end
  if s == "key_too_long" then return { fairness_key = string.rep("k", 10000) } end
  return { fairness_key = "good", weight = 3, throttle_keys = { "tk1", "tk2" } }
end
"""
BAD_SHAPES = [
    "string",
    "nothing",
    "number",
    "weight_zero",
    "weight_negative",
    "weight_string",
    "weight_fraction",
    "weight_huge",
    "throttle_string",
    "throttle_numbers",
    "throttle_empty_string",
    "key_number",
    "key_empty",
    "key_table",
    "key_too_long",
]


def test_wrong_return_shapes_fall_back_to_defaults(hostile_server: ServerProcess) -> None:
    with connect(hostile_server.addr) as fila:
        queue = unique("shapes")
        fila.create_queue(queue, on_enqueue=SHAPES)
        shape_of = {}
        for shape in [*BAD_SHAPES, "good"]:
            shape_of[fila.enqueue(queue, b"s", {"shape": shape})] = shape
        messages = drain(fila, queue, len(shape_of))
        for mid, message in messages.items():
            shape = shape_of[mid]
            if shape == "good":
                meta = message.metadata
                assert (meta.fairness_key, meta.weight, list(meta.throttle_keys)) == (
                    "good",
                    3,
                    ["tk1", "tk2"],
                )
            else:
                assert_default(message, shape)


def test_compile_error_names_the_hook(hostile_server: ServerProcess) -> None:
    """Issue 9: `on_enqueue:1: unexpected symbol near ...`, not `[string "<python>"]:1:`."""
    with connect(hostile_server.addr) as fila:
        for hook, script_text in (
            ("on_enqueue", "function on_enqueue(m) return { x = } end"),
            ("on_failure", "function on_failure(m)\n  return {\nend"),
        ):
            name = unique("named-" + hook.replace("_", "-"))
            config = admin_pb2.QueueConfig(**{f"{hook}_script": script_text})
            err = rpc_error(
                fila.admin.CreateQueue, admin_pb2.CreateQueueRequest(name=name, config=config)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = err.details() or ""
            line = "1" if hook == "on_enqueue" else "3"
            assert f"{hook}:{line}: unexpected symbol near" in details or (
                f"{hook}:{line}:" in details
            ), details


# --------------------------------------------------------------- oversized inputs

ON_FAILURE_SEES_ERROR = """
function on_failure(m)
  if #m.error <= 4096 and m.error:find("[truncated, ", 1, true) then
    return { action = "dlq" }
  end
  if #m.error <= 4096 then return { action = "retry", delay_ms = 1 } end
  error("error text of " .. #m.error .. " bytes reached Lua")
end
"""


@pytest.mark.parametrize("error_mib", [1, 4])
def test_huge_nack_error_is_truncated_not_fatal(
    server_factory: ServerFactory, error_mib: int
) -> None:
    """Issue 6.1: a Nack error of 1 MiB or more on a queue with on_failure aborted the
    broker (PANIC: unprotected error ... not enough memory). It must reach the hook
    cut to 4 KiB with a marker, and the broker must carry on."""
    server = server_factory(config_toml=NO_BREAKER)
    with connect(server.addr) as fila:
        fila.create_queue("big-errors", on_failure=ON_FAILURE_SEES_ERROR)
        mid = fila.enqueue("big-errors", b"x")
        with TimedConsumer(fila.channel, "big-errors") as consumer:
            _, message = consumer.get(T)
            assert message.id == mid
            fila.svc.Nack(
                service_pb2.NackRequest(
                    queue="big-errors", message_id=mid, error="é" * (error_mib * 2**19)
                ),
                timeout=T,
            )
        assert server.running, "the broker died on a large nack error"
        # the hook saw the truncated text and dead-lettered the message
        with TimedConsumer(fila.channel, "big-errors.dlq") as dlq:
            _, dead = dlq.get(T)
        assert dead.id == mid
        assert fila.enqueue("big-errors", b"still serving")
        assert server.running


HEADER_COUNTER = """
function on_enqueue(m)
  local n = 0
  for _ in pairs(m.headers) do n = n + 1 end
  return { fairness_key = "n" .. n .. "-omitted" .. tostring(m.headers_omitted or 0) }
end
"""


def test_huge_header_set_is_bounded(server_factory: ServerFactory) -> None:
    """Headers cross into Lua bounded: with limits raised far past the defaults, a
    message with 8 MiB of headers still enqueues, the hook sees at most 256 KiB of them
    and how many were left out, and the broker stays up."""
    server = server_factory(
        config_toml=NO_BREAKER
        + "[server]\nmax_headers = 100000\nmax_header_bytes = 16777216\n"
        + "max_request_bytes = 33554432\n"
    )
    # 3.2 MB: past what crosses into Lua, within a client's 4 MiB receive limit
    headers = {f"h{i:05d}": "v" * 400 for i in range(8000)}
    with connect(server.addr) as fila:
        fila.create_queue("many-headers", on_enqueue=HEADER_COUNTER)
        fila.create_queue(
            "many-headers-fail",
            on_failure='function on_failure(m) return { action = "dlq" } end',
        )
        mid = fila.enqueue("many-headers", b"x", headers)
        fila.enqueue("many-headers", b"y", {"a": "b"})
        keys = {k.key for k in fila.stats("many-headers").per_key_stats}
        assert "n1-omitted0" in keys, keys
        big = [k for k in keys if k != "n1-omitted0"]
        assert len(big) == 1 and not big[0].endswith("omitted0"), keys
        # and through on_failure
        fail_id = fila.enqueue("many-headers-fail", b"x", headers)
        with TimedConsumer(fila.channel, "many-headers-fail") as consumer:
            consumer.get(T)
            fila.nack("many-headers-fail", fail_id, "e")
        with TimedConsumer(fila.channel, "many-headers-fail.dlq") as dlq:
            assert dlq.get(T)[1].id == fail_id
        assert mid and server.running


# --------------------------------------------------------------- UTF-8 and outcomes

BAD_UTF8_ENQUEUE = r"""
function on_enqueue(m)
  local mode = m.headers.mode
  if mode == "sub" then return { fairness_key = m.headers.tenant:sub(1, 1) } end
  if mode == "throttle" then return { throttle_keys = { "\xff\xfe" } } end
  if mode == "nul" then return { fairness_key = "a\0b" } end
  if mode == "error" then error("\xff\xfe broken") end
  if mode == "error_nil" then error(nil) end
  if mode == "error_table" then error({}) end
  return { fairness_key = "fine" }
end
"""
BAD_UTF8_FAILURE = r"""
function on_failure(m)
  if m.attempts == 1 then error("\xc3") end
  if m.attempts == 2 then return { action = "\xff" } end
  return { action = "retry" }
end
"""


def test_invalid_utf8_and_odd_outcomes_fall_back(hostile_server: ServerProcess) -> None:
    """Issue 6.4: `m.headers.tenant:sub(1,1)` with tenant `é` made Enqueue fail with
    UNKNOWN; from on_failure, the Nack failed after the lease had ended. Every such
    outcome must give the default decision, and the message one well-defined state."""
    with connect(hostile_server.addr) as fila:
        queue = unique("utf8")
        fila.create_queue(queue, on_enqueue=BAD_UTF8_ENQUEUE, on_failure=BAD_UTF8_FAILURE)
        modes = ["sub", "throttle", "nul", "error", "error_nil", "error_table"]
        ids = {fila.enqueue(queue, b"u", {"mode": m, "tenant": "é"}): m for m in modes}
        good = fila.enqueue(queue, b"u", {"mode": "ok"})
        messages = drain(fila, queue, len(ids) + 1)
        for mid, mode in ids.items():
            assert_default(messages[mid], mode)
        assert messages[good].metadata.fairness_key == "fine"

        # on_failure: an error that is not UTF-8, then an action that is not; each
        # nack answers OK and the message comes straight back (the default: retry)
        mid = fila.enqueue(queue, b"f", {"mode": "ok"})
        with TimedConsumer(fila.channel, queue) as consumer:
            for attempt in range(3):
                _, message = consumer.get(T)
                assert message.id == mid and message.metadata.attempt_count == attempt
                fila.nack(queue, mid, "boom")
            _, message = consumer.get(T)
            assert message.metadata.attempt_count == 3
            fila.ack(queue, mid)


def _hooks(on_enqueue: str = "", on_failure: str = "", *, timeout_ms: int = 10) -> QueueHooks:
    class _Clock:
        def now_ms(self) -> int:
            return 0

        def now_ns(self) -> int:
            return 0

    limits = LuaLimits(timeout_ms, 1 << 20, 1_000_000, 10_000)
    return QueueHooks("q", on_enqueue, on_failure, limits, lambda _key: None, _Clock())


ODD_ENQUEUE_RESULTS = [
    r'return { fairness_key = "\xff" }',
    r'return { fairness_key = "a\0b" }',
    r'return { fairness_key = string.rep("k", 300) }',
    r'return { throttle_keys = { "ok", "\xc3\x28" } }',
    r'return { throttle_keys = { "a\0" } }',
    r"return { weight = 0/0 }",
    r"return { weight = math.huge }",
    r"return setmetatable({}, { __index = function() return { fairness_key = 1 } end }).x",
    r'return { fairness_key = setmetatable({}, { __tostring = function() return "x" end }) }',
    r"return coroutine",
    r'error("\xff")',
    r"error(nil)",
    r"error(setmetatable({}, { __tostring = function() while true do end end }))",
    r"error(string.rep('e', 500000))",
    r"local t = {} for i = 1, 1e9 do t[i] = i end",
    r"while true do end",
    r"return string.rep('x', 2^40)",
]


def test_no_outcome_makes_a_hook_raise() -> None:
    """In-process: QueueHooks.on_enqueue / on_failure never raise and count each bad
    outcome as a failure, whatever the script returns or raises."""
    for body in ODD_ENQUEUE_RESULTS:
        hooks = _hooks(f"function on_enqueue(m) {body} end", f"function on_failure(m) {body} end")
        assert hooks.on_enqueue({"h": "\udcff"}, 1) == DEFAULT_ENQUEUE, body
        assert hooks.on_failure("id", {"h": "v"}, 1, "\udcff") == DEFAULT_FAILURE, body
        counters = hooks.counters()
        assert counters["on_enqueue"].failed == 1 and counters["on_failure"].failed == 1, body
        assert "\n" not in counters["on_enqueue"].last_error


# --------------------------------------------------------------- print

PRINTER = r"""
function on_enqueue(m)
  for i = 1, 100000 do
    print("forged\n2030-01-01 level=CRITICAL logger=fila.server boom", i, string.rep("z", 5000))
  end
  return { fairness_key = "printed" }
end
"""


def test_print_is_logged_marked_quoted_and_rate_limited(server_factory: ServerFactory) -> None:
    """Issue 6.5: print wrote to stdout (370 MB from three enqueues) and could forge
    log lines. Now each print is at most one quoted `lua print` line, rate limited."""
    server = server_factory(config_toml=NO_BREAKER)
    with connect(server.addr) as fila:
        fila.create_queue("printer", on_enqueue=PRINTER)
        before = len(server.log_text())
        began = time.monotonic()
        for _ in range(3):
            fila.enqueue("printer", b"p")
        elapsed = time.monotonic() - began
        keys = {k.key for k in fila.stats("printer").per_key_stats}
        log = server.log_text()[before:]
    lines = [line for line in log.splitlines() if "lua print" in line]
    assert lines, log[-2000:]
    assert len(log) < 100_000, f"{len(log)} bytes of log from three enqueues"
    # a burst of 20, then 10 a second
    allowed = 20 + 10 * elapsed + 1
    assert len(lines) <= allowed, (
        f"{len(lines)} print lines in {elapsed:.2f}s (allowed {allowed:.0f})"
    )
    for line in lines:
        assert "queue=printer" in line and "hook=on_enqueue" in line, line
        assert len(line) < 1000, len(line)
    # the forged text stays inside the quoted value: no line of its own
    assert not any(line.startswith("2030-01-01") for line in log.splitlines()), log[-2000:]
    assert keys <= {"printed", "default"}


# --------------------------------------------------------------- hook failure lines

SOMETIMES_FAILING = """
function on_enqueue(m)
  if m.headers.bad then error(m.headers.bad) end
  return { fairness_key = "fine" }
end
"""


def _hook_failure_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "lua hook failed" in line]


def test_hook_failures_are_rate_limited_and_the_dropped_ones_counted(
    server_factory: ServerFactory,
) -> None:
    """A hook that fails for every second message never opens the breaker (successes
    reset it): it logged one WARNING per failure, each with up to 500 characters the
    producer chose (1,000 lines in 2.7 s). Now a burst of 10 and one a second per queue,
    and the next line that gets through counts the dropped ones, so every failure is
    accounted for."""
    server = server_factory()
    big = "x" * 400
    with connect(server.addr) as fila:
        fila.create_queue("flaky", on_enqueue=SOMETIMES_FAILING)
        before = len(server.log_text())
        began = time.monotonic()
        failures = 0
        for i in range(400):
            failing = i % 2 == 1
            fila.enqueue("flaky", b"p", {"bad": f"boom {i} {big}"} if failing else {})
            failures += failing
        elapsed = time.monotonic() - began
        flood = _hook_failure_lines(server.log_text()[before:])
        allowed = 10 + 1 * elapsed + 1
        assert 0 < len(flood) <= allowed, f"{len(flood)} lines in {elapsed:.2f}s"

        def a_line_with_the_dropped_count() -> bool:
            nonlocal failures
            # a success first: three failures in a row would open the breaker
            fila.enqueue("flaky", b"p")
            # the line, if any, is written before Enqueue answers
            fila.enqueue("flaky", b"p", {"bad": "again"})
            failures += 1
            # this failure's own line: a line of the first 400 written after their first
            # second (a loaded machine) carries a count too, with failures still pending
            last = _hook_failure_lines(server.log_text()[before:])[-1]
            return "again" in last and "dropped_before=" in last

        # a token comes back within a second; the interval only paces the polling
        wait_until(a_line_with_the_dropped_count, 10, interval=0.05, what="dropped count")
        stats = fila.stats("flaky")
    lines = _hook_failure_lines(server.log_text()[before:])
    dropped = [
        int(line.split("dropped_before=")[1].split()[0])
        for line in lines
        if "dropped_before=" in line
    ]
    # the last failure was logged: nothing is pending, every failure is a line or counted
    assert len(lines) + sum(dropped) == failures, (len(lines), dropped, failures)
    assert all("queue=flaky" in line and "hook=on_enqueue" in line for line in lines)
    assert stats.depth == 2 * failures  # every message was taken, failing or not


# --------------------------------------------------------------- in-process checks


@pytest.mark.parametrize("limit", [0, 300, None], ids=["lua-only", "mixed", "default"])
def test_patterns_agree_with_c(limit: float | None) -> None:
    """The Lua matcher (and the C/Lua mix the wrappers use) give exactly what Lua's C
    string.find/match/gmatch/gsub give, errors included, on random patterns built from
    every pattern item (classes, sets, captures, %b, %f, back references, anchors,
    malformed pieces) and random subjects."""
    parity = Parity(limit)
    rnd = random.Random(20260601)
    failures = []
    for _ in range(6000):
        op, s, p, init, repl, n = random_case(rnd)
        why = parity.compare(op, s, p, init, repl, n)
        if why is not None:
            failures.append(f"{op}({s!r}, {p!r}, {init}, {repl!r}, {n}): {why}")
    assert not failures, "\n".join(failures[:20])


def _busy(stop: threading.Event) -> None:
    data = random.Random(1).randbytes(1 << 20)
    while not stop.is_set():
        zlib.compress(data, 6)  # releases the GIL: real CPU on another core


def test_budget_charges_only_the_calling_thread() -> None:
    """Issue 6.3: charged to the process CPU clock, a 4 ms hook under a 10 ms budget
    failed 18 of 20 calls while three other threads were busy. Charged to the calling
    thread, a hook well under budget never fails, however busy the process is."""
    hooks = _hooks("function on_enqueue(m) local x = 0 for i = 1, N do x = x + i end return {} end")
    # calibrate N to about 4 ms of this thread's CPU
    probe = _hooks(
        "function on_enqueue(m) local x = 0 for i = 1, 200000 do x = x + i end return {} end",
        timeout_ms=10_000,
    )
    cpu = min(_thread_cpu(lambda: probe.on_enqueue({}, 0)) for _ in range(5))
    n = int(200000 * 0.004 / cpu)
    hooks = _hooks(
        f"N = {n}\nfunction on_enqueue(m) local x = 0 for i = 1, N do x = x + i end return {{}} end"
    )
    stop = threading.Event()
    workers = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(20):
            hooks.on_enqueue({}, 0)
    finally:
        stop.set()
        for worker in workers:
            worker.join(T)
    counters = hooks.counters()["on_enqueue"]
    assert counters.failed == 0, (
        f"{counters.failed} of 20 calls of a ~4 ms hook failed under a 10 ms budget "
        f"while 3 threads were busy: {counters.last_error}"
    )


def _thread_cpu(fn: object) -> float:
    began = time.thread_time()
    fn()  # type: ignore[operator]
    return time.thread_time() - began


def test_script_size_is_bounded() -> None:
    with pytest.raises(ScriptError, match="limited to"):
        _hooks("function on_enqueue(m) return {} end --" + "x" * 300_000)


FILL_GLOBALS = """
local size
local function grow() hoard[#hoard + 1] = string.rep("h", size) end
local function grow_chain() chain = { chain } end
function on_enqueue(m)
  if not full then
    -- fill the state to its cap with live data and no garbage an emergency
    -- collection could free: big pieces first, then ever smaller ones
    full, hoards = true, {}
    for _, s in ipairs({ 65536, 4096, 256, 16 }) do
      hoard, size = {}, s
      hoards[#hoards + 1] = hoard
      while pcall(grow) do end
    end
    while pcall(grow_chain) do end
  end
  return { fairness_key = "k" .. #m.headers.big }
end
"""


def test_values_cross_into_lua_at_the_memory_cap(hostile_server: ServerProcess) -> None:
    """A script may keep its state at the memory cap. Lupa copies arguments into Lua
    outside any protected call, so a failed allocation there aborts the process: the
    cap must be lifted while values cross, whatever the script holds."""
    with connect(hostile_server.addr) as fila:
        queue = unique("at-cap")
        fila.create_queue(queue, on_enqueue=FILL_GLOBALS)
        for size in (10, 20_000, 60_000):
            fila.enqueue(queue, b"c", {"big": "b" * size})
        assert hostile_server.running and broker_answers(fila)


def test_loading_a_hook_never_runs_an_earlier_scripts_metamethods() -> None:
    """Loading on_failure clears its name in the shared environment raw: on_enqueue's
    __newindex on _G would otherwise run there, outside every budget (a loop in it
    froze the broker for good)."""
    on_enqueue = """
    function on_enqueue(m) return { fairness_key = cleared and "ran" or "clean" } end
    setmetatable(_G, { __newindex = function(t, k, v)
      if v == nil then rawset(t, "cleared", true) else rawset(t, k, v) end
    end })
    """
    hooks = _hooks(on_enqueue, 'function on_failure(m) return { action = "dlq" } end')
    assert hooks.on_enqueue({}, 1).fairness_key == "clean"


@pytest.mark.parametrize("weight", ["4", "4.0", "2^2", "8/2", 'tonumber("4.0")'])
def test_a_whole_number_weight_is_taken_whatever_its_lua_type(weight: str) -> None:
    hooks = _hooks(f'function on_enqueue(m) return {{ fairness_key = "k", weight = {weight} }} end')
    decision = hooks.on_enqueue({}, 1)
    assert (decision.fairness_key, decision.weight) == ("k", 4)
    assert hooks.counters()["on_enqueue"].failed == 0


def test_time_spent_inside_one_instruction_counts_against_the_budget() -> None:
    """A chain of __call metamethods is followed inside one OP_CALL, where no hook fires
    (0.2-0.4 s here against a 10 ms budget). The first such call only makes the next
    one measure its CPU time (wall time alone cannot tell a stall from a thread that
    waited for a CPU); from the second on it fails on its budget, so the breaker can
    stop a script that does it every time."""
    hooks = _hooks(
        """
        local t = setmetatable({}, {})
        getmetatable(t).__call = t
        function on_enqueue(m)
          pcall(t)
          return { fairness_key = "stalled" }
        end
        """
    )
    hooks.on_enqueue({}, 1)
    assert hooks.on_enqueue({}, 1) == DEFAULT_ENQUEUE
    assert hooks.on_enqueue({}, 1) == DEFAULT_ENQUEUE
    counters = hooks.counters()["on_enqueue"]
    assert counters.failed >= 2 and "budget" in counters.last_error


def test_failure_log_lets_a_burst_through_then_one_a_second_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In-process, on a clock the test moves: the limit, and the count carried by the
    next line that gets through."""
    now = [100.0]
    failure_log = FailureLog("q", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="fila.lua"):
        for i in range(100):
            failure_log.failed("on_enqueue", f"boom {i}")
        assert len(caplog.records) == 10
        assert failure_log.dropped == 90
        now[0] += 1.0
        failure_log.failed("on_failure", "later")
    last = caplog.records[-1]
    assert len(caplog.records) == 11 and failure_log.dropped == 0
    assert last.dropped_before == 90 and last.hook == "on_failure"  # type: ignore[attr-defined]
    assert (last.error, last.queue) == ("later", "q")  # type: ignore[attr-defined]
    assert getattr(caplog.records[0], "dropped_before", None) is None


def test_a_queue_of_sometimes_failing_hooks_logs_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In-process: QueueHooks sends its failures through the limit (every one is still
    counted in the hook's counters)."""
    hooks = _hooks(SOMETIMES_FAILING)
    with caplog.at_level(logging.WARNING, logger="fila.lua"):
        for i in range(200):
            hooks.on_enqueue({"bad": "boom"} if i % 2 else {}, 1)
    assert hooks.counters()["on_enqueue"].failed == 100
    assert 1 <= len(caplog.records) <= 12, len(caplog.records)


def test_a_call_whose_thread_waited_for_a_cpu_does_not_fail() -> None:
    """On the clock a test moves: a short hook whose thread was held 0.5 s of wall time
    (descheduled on a loaded host) is not failed; the next call measures its own CPU
    time instead, finds it short, and the state trusts the wall clock again."""
    wall = [0.0]

    def descheduled() -> float:
        wall[0] += 0.25  # each read a quarter second later: every call holds 0.5 s
        return wall[0]

    sandbox = LuaSandbox(
        queue="q",
        timeout_ms=10,
        memory_limit_bytes=1 << 20,
        config_get=lambda key: None,
        wall_clock=descheduled,
    )
    sandbox.load("on_enqueue", 'function on_enqueue(m) return { fairness_key = "k" } end')
    outcomes = [sandbox.on_enqueue({}, 1)[0] for _ in range(5)]
    assert outcomes == [True] * 5


def test_a_call_that_held_its_cpu_past_the_bound_fails_from_the_second_time() -> None:
    """Held past the bound on both clocks (a stall inside one instruction, where the
    budget is never checked): the first call only raises suspicion, the next ones fail."""
    cpu = [0.0]
    stalling = [False]

    def stalled() -> float:
        cpu[0] += 0.25 if stalling[0] else 1e-6
        return cpu[0]

    sandbox = LuaSandbox(
        queue="q",
        timeout_ms=10,
        memory_limit_bytes=1 << 20,
        config_get=lambda key: None,
        wall_clock=stalled,
        thread_clock=stalled,
    )
    sandbox.load("on_enqueue", 'function on_enqueue(m) return { fairness_key = "k" } end')
    stalling[0] = True
    outcomes = [sandbox.on_enqueue({}, 1) for _ in range(3)]
    assert [o[0] for o in outcomes] == [True, False, False]
    assert outcomes[1][1] == BUDGET_EXHAUSTED.decode()
