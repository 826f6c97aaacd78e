"""Policy: a queue's Lua hooks as the core runs them, and what happens when they fail.

SPEC 2, Lua hooks: `on_enqueue(msg)` (headers, payload_size, queue) returns the
message's fairness key, weight and throttle keys; `on_failure(msg)` (id, headers,
attempts, queue, error) returns `{action="retry", delay_ms=N}` or `{action="dlq"}`;
`fila.get(key)` reads runtime config. A hook that errors or returns garbage falls
back to the defaults for that message and is counted; `lua.circuit_breaker_threshold`
consecutive failures bypass it for `lua.circuit_breaker_cooldown_ms`.
The sandbox itself (budgets, memory, hostile scripts) is tests/test_lua_*.py's.
"""

from __future__ import annotations

from support.core import CoreBroker, config, make_core, run_async

from fila.core.errors import MessageNotFound

TENANT = """
function on_enqueue(m)
  if m.headers.tenant == nil then
    return { fairness_key = m.queue .. "/" .. tostring(m.payload_size) }
  end
  return {
    fairness_key = "tenant-" .. m.headers.tenant,
    weight = tonumber(m.headers.w),
    throttle_keys = { "rate:" .. m.headers.tenant, "global" },
  }
end
"""

DLQ_AFTER_3 = """
function on_failure(m)
  if m.attempts >= 3 then return { action = "dlq" } end
  return { action = "retry" }
end
"""


async def _deliver_and_nack(core: CoreBroker, queue: str, message_id: str, error: str) -> None:
    consumer = await core.attach(queue)
    assert core.take(consumer) == [message_id]
    assert await core.nack(queue, message_id, error=error) == [None]
    await core.detach(consumer)


# -- on_enqueue -------------------------------------------------------------------------------


@run_async
async def test_on_enqueue_decides_each_messages_fairness_key_weight_and_throttle_keys() -> None:
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    (first,) = await core.enqueue_each("q", [{"tenant": "acme", "w": "3"}])
    (second,) = await core.enqueue_each("q", [{"tenant": "acme", "w": "2"}])
    (third,) = await core.enqueue("q")  # payload b"0": one byte
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    got = {m.id: m.metadata for m in core.receive(consumer)}
    assert {
        message_id: (meta.fairness_key, meta.weight, list(meta.throttle_keys), meta.queue_id)
        for message_id, meta in got.items()
    } == {
        first: ("tenant-acme", 3, ["rate:acme", "global"], "q"),
        second: ("tenant-acme", 2, ["rate:acme", "global"], "q"),
        third: ("q/1", 1, [], "q"),
    }


@run_async
async def test_a_failing_on_enqueue_gives_the_message_the_defaults_and_is_counted() -> None:
    core = make_core()
    await core.create_queue(
        "q",
        on_enqueue="function on_enqueue(m) if m.headers.bad then error('no tenant') end "
        'return { fairness_key = "ok", weight = 2 } end',
    )
    ids = await core.enqueue_each("q", [{"bad": "1"}, {}, {"bad": "1"}])
    assert len(ids) == 3, "every message is stored"
    assert {(k.key, k.pending, k.weight) for k in core.stats("q").per_key} == {
        ("default", 2, 1),
        ("ok", 1, 2),
    }
    counters = core.hook_counters("q")["on_enqueue"]
    assert (counters.ok, counters.failed, counters.bypassed) == (1, 2, 0)
    assert "no tenant" in counters.last_error
    assert counters.last_error_at_ms == core.now_ms()


@run_async
async def test_on_enqueue_reads_config_set_after_the_queue_was_created() -> None:
    core = make_core()
    await core.create_queue(
        "q", on_enqueue='function on_enqueue(m) return { fairness_key = fila.get("fk") } end'
    )
    expected: dict[str, str] = {}
    for value in (None, "alpha", "beta", ""):  # None: never set; "": deleted again
        if value is not None:
            await core.set_config("fk", value)
        (message_id,) = await core.enqueue("q")
        expected[message_id] = value or "default"
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert {m.id: m.metadata.fairness_key for m in core.receive(consumer)} == expected


# -- on_failure -------------------------------------------------------------------------------

ON_FAILURE_INSPECTS = """
function on_failure(m)
  local ok = m.error == "fatal"
    and m.headers.kind == "x"
    and m.queue == "inspect"
    and m.id == fila.get("expect_id")
    and m.attempts == tonumber(fila.get("expect_attempts"))
  if ok then return { action = "dlq" } end
  return { action = "retry" }
end
"""


@run_async
async def test_on_failure_sees_the_id_headers_attempts_queue_and_error() -> None:
    """The hook dead-letters only when every field it is given is what the test
    expects, so each case changes one field: then the message is retried instead."""
    core = make_core()
    await core.create_queue("inspect", on_failure=ON_FAILURE_INSPECTS)
    await core.create_queue("inspect2", on_failure=ON_FAILURE_INSPECTS)  # another m.queue

    async def outcome(queue: str, kind: str, expect_id: str | None, error: str) -> str:
        """What one nack of a new message does, the hook expecting attempts == 1."""
        (message_id,) = await core.enqueue_each(queue, [{"kind": kind}])
        await core.set_config("expect_id", expect_id or message_id)
        await core.set_config("expect_attempts", "1")
        await _deliver_and_nack(core, queue, message_id, error)
        dead = message_id in core.attempts(queue + ".dlq")
        assert dead != (message_id in core.attempts(queue))
        await core.purge(queue)
        return "dlq" if dead else "retry"

    assert await outcome("inspect", "x", None, "fatal") == "dlq"
    assert await outcome("inspect", "x", None, "transient") == "retry"
    assert await outcome("inspect", "y", None, "fatal") == "retry"
    assert await outcome("inspect", "x", "someone-else", "fatal") == "retry"
    assert await outcome("inspect2", "x", None, "fatal") == "retry"
    # attempts counts failures, this one included: 3 on the third nack, not before
    await core.set_config("expect_attempts", "3")
    (message_id,) = await core.enqueue_each("inspect", [{"kind": "x"}])
    await core.set_config("expect_id", message_id)
    await _deliver_and_nack(core, "inspect", message_id, "fatal")
    await _deliver_and_nack(core, "inspect", message_id, "fatal")
    assert core.attempts("inspect") == {message_id: 2}
    await _deliver_and_nack(core, "inspect", message_id, "fatal")
    assert core.attempts("inspect.dlq")[message_id] == 3


@run_async
async def test_on_failure_dead_letters_after_three_attempts_keeping_the_whole_message() -> None:
    core = make_core()
    await core.create_queue("orders", on_enqueue=TENANT, on_failure=DLQ_AFTER_3)
    headers = {"tenant": "acme", "w": "3", "trace": "abc"}
    (message_id,) = await core.enqueue_each("orders", [headers])
    for attempt in range(3):
        assert core.attempts("orders") == {message_id: attempt}
        await _deliver_and_nack(core, "orders", message_id, "boom")
    assert core.depth("orders") == (0, 0)
    assert core.depth("orders.dlq") == (1, 0)
    assert core.stats("orders").counters.dead_lettered == 1
    assert isinstance((await core.ack("orders", message_id))[0], MessageNotFound)
    dlq = await core.attach("orders.dlq")
    (dead,) = core.receive(dlq)
    assert (dead.id, dict(dead.headers)) == (message_id, headers)
    meta = dead.metadata
    assert (meta.attempt_count, meta.queue_id) == (3, "orders.dlq")
    assert (meta.fairness_key, meta.weight) == ("tenant-acme", 3)
    assert list(meta.throttle_keys) == ["rate:acme", "global"]
    assert await core.ack("orders.dlq", message_id) == [None]
    assert core.depth("orders.dlq") == (0, 0)


@run_async
async def test_a_nack_on_a_stream_consume_stream_runs_on_failure_like_a_nack_call() -> None:
    core = make_core()
    await core.create_queue("q", on_failure='function on_failure(m) return { action = "dlq" } end')
    ids = await core.enqueue("q", 2)
    consumer = await core.attach("q", prefetch=2, max_batch=2, stream=True)
    assert core.take(consumer) == ids
    await core.settle_on_stream(consumer, nacks=[(message_id, "boom") for message_id in ids])
    assert sorted(core.attempts("q.dlq")) == sorted(ids) and core.depth("q") == (0, 0)
    assert core.stats("q").counters.nacked == 2
    assert core.hook_counters("q")["on_failure"].ok == 2


@run_async
async def test_a_failing_on_failure_retries_at_once_and_is_counted() -> None:
    core = make_core()
    await core.create_queue("q", on_failure="function on_failure(m) return { action = 7 } end")
    (message_id,) = await core.enqueue("q")
    await _deliver_and_nack(core, "q", message_id, "boom")
    assert core.attempts("q") == {message_id: 1} and core.depth("q") == (1, 0)
    assert core.hook_counters("q")["on_failure"].failed == 1


@run_async
async def test_on_failure_sees_a_long_error_clipped_to_4_kib() -> None:
    core = make_core()
    await core.create_queue(
        "q",
        on_failure="function on_failure(m) "
        'if #m.error <= 4096 and m.error:find("truncated", 1, true) then '
        'return { action = "dlq" } end return { action = "retry" } end',
    )
    (message_id,) = await core.enqueue("q")
    await _deliver_and_nack(core, "q", message_id, "x" * 100_000)
    assert core.attempts("q.dlq") == {message_id: 1}


# -- the circuit breaker ----------------------------------------------------------------------

COUNTING = """
calls = 0
function on_enqueue(m)
  calls = calls + 1
  if fila.get("fail") == "1" then error("failing on purpose") end
  return { fairness_key = "script-" .. calls }
end
"""


@run_async
async def test_the_breaker_bypasses_a_hook_that_failed_3_times_for_its_cooldown() -> None:
    core = make_core(
        config=config("[lua]\ncircuit_breaker_threshold = 3\ncircuit_breaker_cooldown_ms = 1500\n")
    )
    await core.create_queue("cb", on_enqueue=COUNTING)

    def pending() -> dict[str, int]:
        return {k.key: k.pending for k in core.stats("cb").per_key}

    await core.enqueue("cb")  # call 1
    assert pending() == {"script-1": 1}
    await core.set_config("fail", "1")
    await core.enqueue("cb", 3)  # calls 2 to 4 fail: the breaker opens
    assert pending() == {"script-1": 1, "default": 3}
    await core.set_config("fail", "0")
    await core.advance(1499)
    await core.enqueue("cb", 2)  # bypassed, although the hook would succeed now
    assert pending() == {"script-1": 1, "default": 5}
    counters = core.hook_counters("cb")["on_enqueue"]
    assert (counters.ok, counters.failed, counters.bypassed) == (1, 3, 2)
    await core.advance(1)
    await core.enqueue("cb")  # the cooldown is over: the script runs, call 5
    assert pending() == {"script-1": 1, "default": 5, "script-5": 1}


@run_async
async def test_a_hook_that_fails_for_some_messages_only_never_opens_the_breaker() -> None:
    core = make_core()
    await core.create_queue(
        "q",
        on_enqueue="function on_enqueue(m) if m.headers.bad then error('bad') end "
        'return { fairness_key = "ok" } end',
    )
    await core.enqueue_each("q", [{"bad": "1"}, {"bad": "1"}, {}] * 5)
    counters = core.hook_counters("q")["on_enqueue"]
    assert (counters.ok, counters.failed, counters.bypassed) == (5, 10, 0)
    assert {k.key: k.pending for k in core.stats("q").per_key} == {"default": 10, "ok": 5}
