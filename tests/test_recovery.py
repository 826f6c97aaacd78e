"""Durability and recovery (SPEC section 2): restart, kill -9, and what comes back.

Every test runs real `fila-server` processes on a real RocksDB data directory and
talks raw `fila.v1` gRPC. A crash is SIGKILL (`ServerProcess.kill`), a graceful stop
is SIGTERM; both are followed by `start()` on the same port and data directory.
Waits are conditions with deadlines; the only fixed pauses are the windows in which
a test asserts that something does *not* happen.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from support import ServerFactory, async_wait_until, wait_until
from support.stubs import ConsumeStream, Fila, connect, rpc_error

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, messages_pb2, service_pb2, service_pb2_grpc

RPC_S = 10.0
# How long a test waits for something that should happen promptly.
PROMPT_S = 10.0
# The window in which a test asserts that a consumer is *not* given a message.
QUIET_S = 1.0


def _ms(stamp: object) -> int:
    """A `google.protobuf.Timestamp` as epoch milliseconds."""
    return int(stamp.seconds) * 1000 + int(stamp.nanos) // 1_000_000  # type: ignore[attr-defined]


def _set_config(fila: Fila, key: str, value: str) -> None:
    fila.admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value=value), timeout=RPC_S)


def _expect_nothing(stream: ConsumeStream, window: float, why: str) -> None:
    try:
        message = stream.get(window)
    except TimeoutError:
        return
    raise AssertionError(
        f"{why}: {stream.queue_name!r} delivered {message.id} (attempt_count "
        f"{message.metadata.attempt_count}) within {window}s"
    )


def _key_stats(stats: admin_pb2.GetStatsResponse) -> dict[str, tuple[int, int]]:
    """fairness key -> (pending_count, weight)."""
    return {k.key: (k.pending_count, k.weight) for k in stats.per_key_stats}


def _code(call: Callable[..., object], *args: object) -> grpc.StatusCode:
    return rpc_error(call, *args).code()


def _take_acking(fila: Fila, stream: ConsumeStream, count: int) -> list[messages_pb2.Message]:
    """The next `count` deliveries, each acked as it arrives (a consumer holds only a
    bounded number of unacked messages)."""
    got = []
    deadline = time.monotonic() + PROMPT_S
    for _ in range(count):
        message = stream.get(max(0.0, deadline - time.monotonic()))
        fila.ack(stream.queue_name, message.id)
        got.append(message)
    return got


# ---------------------------------------------------------------------------------------
# 1. Graceful restart
# ---------------------------------------------------------------------------------------

# Fairness key from a header; weight from a header, else from runtime config (so the
# script reading `fila.get` after a restart shows the config came back too).
ON_ENQUEUE_TENANT = """
function on_enqueue(msg)
  local w = msg.headers["w"] or fila.get("app.default_weight") or "1"
  return { fairness_key = msg.headers["tenant"] or "default", weight = tonumber(w) }
end
"""

ON_FAILURE_BY_FATE = """
function on_failure(msg)
  if msg.headers["fate"] == "dlq" then return { action = "dlq" } end
  if msg.headers["fate"] == "later" then return { action = "retry", delay_ms = 60000 } end
  return { action = "retry", delay_ms = 0 }
end
"""

ORDERS_VISIBILITY_MS = 2000

# (tenant, weight) in enqueue order; tenant a changes weight on its last message, so
# the rebuilt ring must take the weight of each key's most recent message.
ORDERS_PLAN = [
    (tenant, weight)
    for i in range(6)
    for tenant, weight in (("a", 2 if i == 5 else 1), ("b", 2), ("c", 3))
    if not (tenant == "c" and i >= 4)
]


def test_graceful_restart_restores_queues_messages_config_and_drr(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    order: dict[str, list[str]] = defaultdict(list)
    with connect(server.addr) as fila:
        fila.create_queue(
            "orders",
            on_enqueue=ON_ENQUEUE_TENANT,
            on_failure=ON_FAILURE_BY_FATE,
            visibility_timeout_ms=ORDERS_VISIBILITY_MS,
        )
        fila.create_queue("plain")
        _set_config(fila, "app.default_weight", "4")
        _set_config(fila, "app.other", "x")
        _set_config(fila, "app.gone", "soon")
        _set_config(fila, "app.gone", "")  # deleted: must stay deleted
        _set_config(fila, "throttle.slow", "5,10")
        for seq, (tenant, weight) in enumerate(ORDERS_PLAN):
            headers = {"tenant": tenant, "w": str(weight), "seq": str(seq)}
            order[tenant].append(fila.enqueue("orders", f"order {seq}".encode(), headers))
        plain_ids = [fila.enqueue("plain", f"plain {i}".encode()) for i in range(3)]
        names_before = fila.queue_names()
        orders_before = fila.stats("orders")
        plain_before = fila.stats("plain")
    assert _key_stats(orders_before) == {
        "a": (6, 2),
        "b": (6, 2),
        "c": (4, 3),
    }, "precondition: the script set keys and weights"

    assert server.stop() == 0, server.log_text()[-2000:]
    server.start()

    with connect(server.addr) as fila:
        assert names_before == ["orders", "orders.dlq", "plain", "plain.dlq"]
        assert fila.queue_names() == names_before
        orders_after = fila.stats("orders")
        plain_after = fila.stats("plain")
        for before, after in ((orders_before, orders_after), (plain_before, plain_after)):
            assert (after.depth, after.in_flight) == (before.depth, before.in_flight)
            assert after.active_fairness_keys == before.active_fairness_keys
            assert _key_stats(after) == _key_stats(before)
            assert after.quantum == before.quantum

        # Runtime config, including its effect on throttling and on Lua.
        entries = fila.admin.ListConfig(admin_pb2.ListConfigRequest(prefix="app."), timeout=RPC_S)
        assert [(e.key, e.value) for e in entries.entries] == [
            ("app.default_weight", "4"),
            ("app.other", "x"),
        ]
        get = fila.admin.GetConfig
        assert get(admin_pb2.GetConfigRequest(key="throttle.slow"), timeout=RPC_S).value == "5,10"
        assert _code(get, admin_pb2.GetConfigRequest(key="app.gone")) == grpc.StatusCode.NOT_FOUND
        throttles = {t.key: (t.rate_per_second, t.burst) for t in orders_after.per_throttle_stats}
        assert throttles == {"slow": (5.0, 10.0)}

        # on_enqueue still runs (tenant from the header, weight from runtime config).
        late = fila.enqueue("orders", b"late", {"tenant": "z"})
        assert _key_stats(fila.stats("orders"))["z"] == (1, 4)
        order["z"].append(late)

        # Ready messages come back in the same FIFO order per fairness key, and the
        # rebuilt ring applies the weights: one DRR round (quantum 1) gives each key
        # as many deliveries as its weight.
        got: dict[str, list[str]] = defaultdict(list)
        with fila.consume("orders") as stream:
            delivered = _take_acking(fila, stream, len(ORDERS_PLAN) + 1)
        for message in delivered:
            assert message.metadata.attempt_count == 0
            got[message.metadata.fairness_key].append(message.id)
        assert got == order
        first_round = Counter(m.metadata.fairness_key for m in delivered[:8])
        assert first_round == {"a": 2, "b": 2, "c": 3, "z": 1}
        with fila.consume("plain") as stream:
            plain_got = [m.id for m in _take_acking(fila, stream, 3)]
        assert plain_got == plain_ids

        # The visibility timeout is the queue's 2000 ms, not the 30 s default (when a
        # lease expires by it: tests/core/test_recovery.py).
        config = fila.admin.GetQueue(admin_pb2.GetQueueRequest(queue="orders"), timeout=RPC_S)
        assert config.config.visibility_timeout_ms == ORDERS_VISIBILITY_MS

        # on_failure still runs: a plain nack retries at once, fate=dlq dead-letters.
        probe = fila.enqueue("orders", b"probe", {"tenant": "a"})
        with fila.consume("orders") as stream:
            assert stream.get(PROMPT_S).id == probe
            fila.nack("orders", probe, "first failure")
            retried = stream.get(PROMPT_S)
            assert (retried.id, retried.metadata.attempt_count) == (probe, 1)
            fila.ack("orders", probe)
            doomed = fila.enqueue("orders", b"to the dlq", {"tenant": "a", "fate": "dlq"})
            assert stream.get(PROMPT_S).id == doomed
            fila.nack("orders", doomed, "fatal")
        with fila.consume("orders.dlq") as stream:
            dead = stream.get(PROMPT_S)
            assert (dead.id, dead.metadata.attempt_count) == (doomed, 1)
            fila.ack("orders.dlq", doomed)


# ---------------------------------------------------------------------------------------
# 2. Leases and their deadlines survive kill -9
# ---------------------------------------------------------------------------------------

LONG_VISIBILITY_MS = 60_000
MID_VISIBILITY_MS = 4000
SHORT_VISIBILITY_MS = 1500


def _lease_one(fila: Fila, queue: str, expected_id: str) -> messages_pb2.Message:
    """Consumes exactly one message and closes the stream, leaving it leased."""
    with fila.consume(queue) as stream:
        message = stream.get(PROMPT_S)
    assert message.id == expected_id
    assert message.metadata.attempt_count == 0
    return message


def test_leases_and_their_deadlines_survive_kill_9(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("long", visibility_timeout_ms=LONG_VISIBILITY_MS)
        fila.create_queue("mid", visibility_timeout_ms=MID_VISIBILITY_MS)
        fila.create_queue("short", visibility_timeout_ms=SHORT_VISIBILITY_MS)
        long_id = fila.enqueue("long", b"long lease", {"k": "long"})
        mid_id = fila.enqueue("mid", b"mid lease")
        short_id = fila.enqueue("short", b"short lease", {"k": "short"})
        _lease_one(fila, "long", long_id)
        mid_leased_ms = _ms(_lease_one(fila, "mid", mid_id).timestamps.leased_at)
        short_leased_ms = _ms(_lease_one(fila, "short", short_id).timestamps.leased_at)
        # A second, ready message in "long": the consumer after the restart must get
        # this one (so it is live) but not the leased one.
        ready_id = fila.enqueue("long", b"ready")
        assert (fila.stats("long").depth, fila.stats("long").in_flight) == (1, 1)
        assert (fila.stats("short").depth, fila.stats("short").in_flight) == (0, 1)

    server.kill()
    # Let the short lease's deadline pass while the broker is down.
    short_deadline_ms = short_leased_ms + SHORT_VISIBILITY_MS
    wait_until(lambda: time.time() * 1000 > short_deadline_ms + 50, 5.0, what="short deadline")
    server.start()
    restarted_ms = time.time() * 1000

    with connect(server.addr) as fila:
        long_stats, short_stats = fila.stats("long"), fila.stats("short")
        assert (long_stats.depth, long_stats.in_flight) == (1, 1), "long lease not restored"
        assert (short_stats.depth, short_stats.in_flight) == (1, 0), "short lease not expired"
        assert (fila.stats("mid").depth, fila.stats("mid").in_flight) == (0, 1)
        mid_stream = fila.consume("mid")
        try:
            # The short lease expired while the broker was down: redelivered, attempt + 1.
            with fila.consume("short") as stream:
                again = stream.get(PROMPT_S)
                assert (again.id, again.metadata.attempt_count) == (short_id, 1)
                assert again.payload == b"short lease"
                assert dict(again.headers) == {"k": "short"}
                fila.ack("short", short_id)

            # The long lease is still held: not redelivered, yet ackable by id.
            with fila.consume("long") as stream:
                fresh = stream.get(PROMPT_S)
                assert (fresh.id, fresh.metadata.attempt_count) == (ready_id, 0)
                fila.ack("long", ready_id)
                _expect_nothing(stream, QUIET_S, "a 60 s lease was redelivered after restart")
            assert fila.stats("long").in_flight == 1
            fila.ack("long", long_id)
            assert (fila.stats("long").depth, fila.stats("long").in_flight) == (0, 0)
            ack = service_pb2.AckRequest(queue="long", message_id=long_id)
            assert _code(fila.svc.Ack, ack) == grpc.StatusCode.NOT_FOUND

            # The mid lease keeps its original deadline: not reset by the restart, not
            # dropped at it.
            mid_deadline_ms = mid_leased_ms + MID_VISIBILITY_MS
            assert restarted_ms + MID_VISIBILITY_MS > mid_deadline_ms + 1000
            redelivered = mid_stream.get(MID_VISIBILITY_MS / 1000 + PROMPT_S)
            arrived_ms = time.time() * 1000
            assert (redelivered.id, redelivered.metadata.attempt_count) == (mid_id, 1)
            assert arrived_ms >= mid_deadline_ms - 5, "mid lease expired before its deadline"
            assert arrived_ms < restarted_ms + MID_VISIBILITY_MS - 500, (
                f"mid lease redelivered {arrived_ms - mid_deadline_ms:.0f} ms after its "
                "deadline: the restart reset it"
            )
            fila.ack("mid", mid_id)
        finally:
            mid_stream.cancel()


PREFETCH = 48  # [scheduler] consumer_buffer: unacked messages one stream may hold
BIG_PAYLOAD = 1_000_000
BIG_MESSAGES = 60
# A client that reads nothing cannot have been sent this many 1 MB messages: HTTP/2
# flow control and socket buffers hold a few MB (about 6 here), not 32.
SURELY_UNSENT_FROM = 32


def test_kill_9_does_not_hold_deliveries_that_were_never_sent(
    server_factory: ServerFactory,
) -> None:
    """A message the broker queued for a stalled stream but never sent is not a lease.

    The consumer reads one message and stops. With 1 MB payloads, HTTP/2 flow
    control soon blocks the stream, while the broker keeps taking messages for it up
    to its prefetch bound and queues them for sending. A graceful stop puts those
    back (ready, attempt 0). After kill -9 they must not be held for the visibility
    timeout and then counted as a failed attempt: no consumer ever saw them.
    """
    server = server_factory(
        persist_mode="sync",
        # stream_buffer_bytes above PREFETCH messages: here only prefetch bounds the stream
        config_toml=f"[scheduler]\nconsumer_buffer = {PREFETCH}\nstream_buffer_bytes = 100000000\n",
    )
    with connect(server.addr) as fila:
        fila.create_queue("big", visibility_timeout_ms=LONG_VISIBILITY_MS)
        ids = [fila.enqueue("big", bytes(BIG_PAYLOAD)) for _ in range(BIG_MESSAGES)]
        stalled = fila.consume("big", read_limit=1)
        try:
            assert stalled.get(PROMPT_S).id == ids[0]
            want = (BIG_MESSAGES - PREFETCH, PREFETCH)

            def prefetch_full() -> bool:
                stats = fila.stats("big")
                return (stats.depth, stats.in_flight) == want

            wait_until(prefetch_full, PROMPT_S, what=f"(depth, in_flight) == {want}")
            server.kill()
        finally:
            stalled.cancel()
    server.start()

    # Leases went out in FIFO order, so ids[:PREFETCH] are leased; the client read
    # ids[0], the transport took a few more, the rest never left the broker.
    never_sent = ids[SURELY_UNSENT_FROM:PREFETCH]
    with connect(server.addr) as fila:
        with fila.consume("big") as stream:
            got: dict[str, int] = {}
            deadline = time.monotonic() + PROMPT_S / 2
            while not set(never_sent) <= got.keys():
                try:
                    message = stream.get(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    break
                got[message.id] = message.metadata.attempt_count
                fila.ack("big", message.id)
        held = [ids.index(i) for i in never_sent if i not in got]
        assert not held, (
            f"after kill -9, {len(held)} messages that never left the broker (positions "
            f"{held[0]}..{held[-1]}) are held as leases for the {LONG_VISIBILITY_MS} ms "
            f"visibility timeout; in_flight after restart {fila.stats('big').in_flight}"
        )
        assert all(got[i] == 0 for i in never_sent), "a never-sent message counted an attempt"


# ---------------------------------------------------------------------------------------
# 3. kill -9 under concurrent producers and an acking consumer
# ---------------------------------------------------------------------------------------

# The generated stubs are typed for the sync API; over a grpc.aio channel they return
# awaitables and async iterators, so the asyncio code below holds them as Any.
AioStub = Any

LOAD_QUEUE = "load"
LOAD_VISIBILITY_MS = 1000
LOAD_CHANNELS = 3
LOAD_PRODUCERS = 12
LOAD_CONSUMERS = 2
DRAIN_CONSUMERS = 4
DRAIN_DEADLINE_S = 45.0


def _payload_for(token: str) -> bytes:
    return f"payload:{token}:".encode() * 4


def _ack_during_load(message_id: str) -> bool:
    """The load consumers ack 15/16 of what they get and let the rest expire.

    Unacked messages hold one of the stream's bounded lease slots until their
    visibility timeout, so this fraction keeps the consumers moving while leases are
    always in flight and expiring.
    """
    return not message_id.endswith("0")


@dataclass
class Ledger:
    """What the clients know happened, from their side of the wire."""

    attempted: set[str] = field(default_factory=set)  # producer tokens sent
    answered: dict[str, str] = field(default_factory=dict)  # token -> id, Enqueue OK
    ack_attempted: set[str] = field(default_factory=set)
    ack_answered: set[str] = field(default_factory=set)
    ack_refused: set[str] = field(default_factory=set)  # NOT_FOUND: the lease had ended
    deliveries: int = 0
    redeliveries: int = 0  # deliveries with attempt_count >= 1
    enqueues_in_flight: int = 0
    killed: bool = False
    errors: list[str] = field(default_factory=list)  # failures before the kill


@dataclass
class Delivery:
    message_id: str
    attempt_count: int
    token: str
    payload: bytes
    phase: int  # how many crashes of the drain came before it
    event: int  # order among everything the drain saw


async def _produce(stub: AioStub, ledger: Ledger, pid: int) -> None:
    seq = 0
    while not ledger.killed:
        token = f"p{pid}-{seq}"
        seq += 1
        ledger.attempted.add(token)
        ledger.enqueues_in_flight += 1
        try:
            reply = await stub.Enqueue(
                service_pb2.EnqueueRequest(
                    queue=LOAD_QUEUE, headers={"token": token}, payload=_payload_for(token)
                ),
                timeout=RPC_S,
            )
        except grpc.aio.AioRpcError as exc:
            if not ledger.killed:
                ledger.errors.append(f"Enqueue {token}: {exc.code()} {exc.details()}")
            return
        finally:
            ledger.enqueues_in_flight -= 1
        ledger.answered[token] = reply.message_id


async def _ack(
    stub: AioStub,
    message_id: str,
    answered: Callable[[str], None],
    refused: set[str],
    killed: Callable[[], bool],
) -> None:
    """Acks one message; an answered ack is reported, NOT_FOUND (the lease ended) is
    collected, and any other failure is an error unless the broker was killed."""
    try:
        await stub.Ack(
            service_pb2.AckRequest(queue=LOAD_QUEUE, message_id=message_id), timeout=RPC_S
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            refused.add(message_id)
        elif not killed():
            raise
        return
    answered(message_id)


async def _consume_during_load(stub: AioStub, ledger: Ledger) -> None:
    acks: set[asyncio.Task[None]] = set()
    call = stub.Consume(service_pb2.ConsumeRequest(queue=LOAD_QUEUE))
    try:
        async for response in call:
            if not response.HasField("message"):
                continue
            message = response.message
            ledger.deliveries += 1
            if message.metadata.attempt_count:
                ledger.redeliveries += 1
            if _ack_during_load(message.id):
                ledger.ack_attempted.add(message.id)
                task = asyncio.create_task(
                    _ack(
                        stub,
                        message.id,
                        ledger.ack_answered.add,
                        ledger.ack_refused,
                        lambda: ledger.killed,
                    )
                )
                acks.add(task)
                task.add_done_callback(acks.discard)
    except grpc.aio.AioRpcError as exc:
        if not ledger.killed:
            ledger.errors.append(f"Consume: {exc.code()} {exc.details()}")
    finally:
        results = await asyncio.gather(*acks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not ledger.killed:
                ledger.errors.append(f"Ack: {result!r}")


@dataclass(frozen=True)
class KillMoment:
    """When to pull the plug, as a condition on what the clients have seen so far."""

    name: str
    min_elapsed_s: float
    min_answered: int
    min_acked: int
    min_redeliveries: int


KILL_MOMENTS = {
    # Producers ramping up, the consumer has just started acking.
    "ramp-up": KillMoment("ramp-up", 0.0, 150, 1, 0),
    # Steady state: enqueues and acks both flowing.
    "steady": KillMoment("steady", 0.8, 500, 100, 0),
    # Leases of unacked messages are expiring and being redelivered meanwhile.
    "expiries": KillMoment("expiries", 1.6, 1000, 200, 5),
}


async def _load_then_kill(server: ServerProcess, moment: KillMoment) -> Ledger:
    ledger = Ledger()
    channels = [grpc.aio.insecure_channel(server.addr) for _ in range(LOAD_CHANNELS)]
    try:
        stubs: list[AioStub] = [service_pb2_grpc.FilaServiceStub(ch) for ch in channels]
        admin: AioStub = admin_pb2_grpc.FilaAdminStub(channels[0])
        await admin.CreateQueue(
            admin_pb2.CreateQueueRequest(
                name=LOAD_QUEUE,
                # Immediate retries: expiries (also those recovery finds) come back at
                # once, so the drain measures crash safety, not the backoff curve.
                config=admin_pb2.QueueConfig(
                    visibility_timeout_ms=LOAD_VISIBILITY_MS, retry_backoff="none"
                ),
            ),
            timeout=RPC_S,
        )
        consumers = [
            asyncio.create_task(_consume_during_load(stub, ledger))
            for stub in stubs[:LOAD_CONSUMERS]
        ]
        producers = [
            asyncio.create_task(_produce(stubs[i % LOAD_CHANNELS], ledger, i))
            for i in range(LOAD_PRODUCERS)
        ]
        began = time.monotonic()

        async def moment_reached() -> bool:
            if ledger.errors:
                raise AssertionError(f"RPCs failed before the kill: {ledger.errors[:5]}")
            return (
                time.monotonic() - began >= moment.min_elapsed_s
                and len(ledger.answered) >= moment.min_answered
                and len(ledger.ack_answered) >= moment.min_acked
                and ledger.redeliveries >= moment.min_redeliveries
                and ledger.enqueues_in_flight > 0
            )

        await async_wait_until(
            moment_reached, 20.0, interval=0.005, what=f"kill moment {moment.name!r}"
        )
        in_flight_at_kill = ledger.enqueues_in_flight
        server.kill()  # SIGKILL while Enqueue and Ack calls are on the wire
        ledger.killed = True
        assert in_flight_at_kill > 0
        await asyncio.wait_for(asyncio.gather(*consumers, *producers), RPC_S)
    finally:
        for ch in channels:
            await ch.close(None)
    return ledger


@dataclass
class Drain:
    """Everything seen after the (first) restart, in the order it was seen."""

    deliveries: list[Delivery] = field(default_factory=list)
    ack_answered: dict[str, int] = field(default_factory=dict)  # id -> event number
    ack_refused: set[str] = field(default_factory=set)
    crashes: int = 0
    _events: int = 0

    def event(self) -> int:
        self._events += 1
        return self._events

    def answered(self, message_id: str) -> None:
        self.ack_answered[message_id] = self.event()


async def _drain(server: ServerProcess, crash_after_acks: int | None) -> Drain:
    """Consumes and acks everything until the queue is empty (depth and in-flight 0).

    With `crash_after_acks`, the broker is SIGKILLed once that many drain acks were
    answered (acks and deliveries in flight), restarted, and the drain resumes.
    """
    drain = Drain()
    while True:
        crash_at = crash_after_acks if drain.crashes == 0 else None
        if not await _drain_phase(server, drain, crash_at):
            return drain
        drain.crashes += 1
        await asyncio.to_thread(server.start)


async def _drain_phase(server: ServerProcess, drain: Drain, crash_at: int | None) -> bool:
    """One drain against one broker process; True if it ended by killing the broker."""
    phase = drain.crashes
    killed = False
    channels = [grpc.aio.insecure_channel(server.addr) for _ in range(2)]
    acks: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    def ack_done(task: asyncio.Task[None]) -> None:
        acks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    async def consume(stub: AioStub) -> None:
        try:
            async for response in stub.Consume(service_pb2.ConsumeRequest(queue=LOAD_QUEUE)):
                if not response.HasField("message"):
                    continue
                m = response.message
                token = m.headers.get("token", "")
                drain.deliveries.append(
                    Delivery(m.id, m.metadata.attempt_count, token, m.payload, phase, drain.event())
                )
                task = asyncio.create_task(
                    _ack(stub, m.id, drain.answered, drain.ack_refused, lambda: killed)
                )
                acks.add(task)
                task.add_done_callback(ack_done)
        except grpc.aio.AioRpcError:
            if not killed:
                raise

    try:
        stubs: list[AioStub] = [service_pb2_grpc.FilaServiceStub(ch) for ch in channels]
        admin: AioStub = admin_pb2_grpc.FilaAdminStub(channels[0])
        consumers = [
            asyncio.create_task(consume(stubs[i % len(stubs)])) for i in range(DRAIN_CONSUMERS)
        ]

        async def drained_or_crash_time() -> bool:
            if failures:
                raise AssertionError(f"Ack failed during the drain: {failures[0]!r}")
            for task in consumers:
                if task.done():
                    raise AssertionError(f"a drain consumer ended: {task.exception()!r}")
            if crash_at is not None:
                return len(drain.ack_answered) >= crash_at and bool(acks)
            stats = await admin.GetStats(admin_pb2.GetStatsRequest(queue=LOAD_QUEUE), timeout=RPC_S)
            return stats.depth == 0 and stats.in_flight == 0 and not acks

        try:
            await async_wait_until(
                drained_or_crash_time,
                DRAIN_DEADLINE_S,
                interval=0.002 if crash_at is not None else 0.05,
                what=f"drain phase {phase} done",
            )
            if crash_at is not None:
                server.kill()  # SIGKILL while acks and deliveries are in flight
                killed = True
                await asyncio.wait_for(asyncio.gather(*acks, return_exceptions=True), RPC_S)
        finally:
            for task in consumers:
                task.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)
    finally:
        for ch in channels:
            await ch.close(None)
    return killed


def _check_after_crash(ledger: Ledger, drain: Drain) -> None:
    id_of_token = ledger.answered
    token_of_id = {message_id: token for token, message_id in id_of_token.items()}
    assert len(token_of_id) == len(id_of_token), "the broker answered one id for two enqueues"

    seen: dict[str, list[Delivery]] = defaultdict(list)
    garbage: list[str] = []
    id_for_token_after: dict[str, str] = {}
    for d in drain.deliveries:
        seen[d.message_id].append(d)
        if d.token not in ledger.attempted:
            garbage.append(f"{d.message_id}: token {d.token!r} was never sent")
        elif d.payload != _payload_for(d.token):
            garbage.append(f"{d.message_id}: payload does not match token {d.token!r}")
        elif d.token in id_of_token and id_of_token[d.token] != d.message_id:
            garbage.append(
                f"{d.message_id}: token {d.token!r} was answered with {id_of_token[d.token]}"
            )
        elif id_for_token_after.setdefault(d.token, d.message_id) != d.message_id:
            garbage.append(
                f"{d.message_id}: token {d.token!r} also stored as {id_for_token_after[d.token]}"
            )
    assert not garbage, f"{len(garbage)} deliveries nobody enqueued: {garbage[:5]}"

    must_survive = set(token_of_id) - ledger.ack_attempted
    lost = sorted(must_survive - seen.keys())
    assert not lost, (
        f"{len(lost)} of {len(must_survive)} answered, never-acked enqueues are gone after "
        f"kill -9, e.g. {[(i, token_of_id[i]) for i in lost[:5]]}"
    )

    resurrected = sorted(ledger.ack_answered & seen.keys())
    resurrected += sorted(
        d.message_id
        for d in drain.deliveries
        if drain.ack_answered.get(d.message_id, d.event) < d.event
    )
    assert not resurrected, (
        f"{len(resurrected)} messages whose Ack was answered came back after kill -9, "
        f"e.g. {resurrected[:5]}"
    )

    duplicates = []
    for message_id, copies in seen.items():
        # A message comes back legitimately only when its previous delivery ended
        # without an answered ack: the broker refused the ack (lease expired) or was
        # killed first. Either way the broker counts the extra attempt.
        for before, after in itertools.pairwise(copies):
            ended = message_id in drain.ack_refused or before.phase < after.phase
            if not ended or after.attempt_count <= before.attempt_count:
                duplicates.append((message_id, [(c.phase, c.attempt_count) for c in copies]))
                break
    assert not duplicates, (
        f"{len(duplicates)} messages delivered more than once after the restart "
        f"(id, [(drain phase, attempt count)]): {duplicates[:5]}"
    )


@pytest.mark.parametrize(
    ("persist_mode", "moment", "crash_in_drain"),
    [
        ("sync", "ramp-up", False),
        ("sync", "steady", False),
        ("sync", "expiries", True),
        ("buffer", "steady", False),
    ],
)
def test_kill_9_under_concurrent_load_loses_and_duplicates_nothing(
    server_factory: ServerFactory, persist_mode: str, moment: str, crash_in_drain: bool
) -> None:
    server = server_factory(persist_mode=persist_mode)

    async def scenario() -> None:
        began = time.monotonic()
        ledger = await _load_then_kill(server, KILL_MOMENTS[moment])
        killed_at = time.monotonic()
        await asyncio.to_thread(server.start)
        restarted_at = time.monotonic()
        # The second crash lands while recovered leases, expiries and acks are live.
        drain = await _drain(server, len(ledger.answered) // 4 if crash_in_drain else None)
        print(
            f"\n[{persist_mode}/{moment}] load {killed_at - began:.2f}s: "
            f"attempted={len(ledger.attempted)} answered={len(ledger.answered)} "
            f"acks answered={len(ledger.ack_answered)} attempted={len(ledger.ack_attempted)} "
            f"refused={len(ledger.ack_refused)} deliveries={ledger.deliveries} "
            f"redeliveries={ledger.redeliveries}; restart {restarted_at - killed_at:.2f}s; "
            f"drain {time.monotonic() - restarted_at:.2f}s: {len(drain.deliveries)} "
            f"deliveries, {len(drain.ack_refused)} acks refused, {drain.crashes} crashes"
        )
        assert drain.crashes == int(crash_in_drain)
        _check_after_crash(ledger, drain)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------
# 4. Delayed retries and dead letters survive kill -9
# ---------------------------------------------------------------------------------------

RETRY_DELAY_MS = 3000
ON_FAILURE_RETRY_LATER = f"""
function on_failure(m) return {{action="retry", delay_ms={RETRY_DELAY_MS}}} end
"""
ON_FAILURE_DLQ = 'function on_failure(m) return {action="dlq"} end'
ON_ENQUEUE_FIXED = (
    'function on_enqueue(m) return {fairness_key="tenant-" .. m.headers["tenant"], weight=3} end'
)


def test_delayed_retry_keeps_its_due_time_across_kill_9(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("retry", on_failure=ON_FAILURE_RETRY_LATER)
        message_id = fila.enqueue("retry", b"try again later", {"h": "1"})
        _lease_one(fila, "retry", message_id)
        nacked_from = time.time()
        fila.nack("retry", message_id, "transient")
        nacked_by = time.time()
    server.kill()
    server.start()

    due_earliest = nacked_from + RETRY_DELAY_MS / 1000
    due_latest = nacked_by + RETRY_DELAY_MS / 1000
    with connect(server.addr) as fila:
        stats = fila.stats("retry")
        assert (stats.depth, stats.in_flight) == (1, 0), "the delayed retry was not recovered"
        with fila.consume("retry") as stream:
            quiet = due_earliest - time.time() - 0.05
            assert quiet > 0.5, f"restart took too long to observe the delay ({quiet:.2f}s left)"
            _expect_nothing(stream, quiet, "a delayed retry came back before its due time")
            again = stream.get(due_latest - time.time() + PROMPT_S)
            arrived = time.time()
            assert again.id == message_id
            assert again.metadata.attempt_count == 1
            assert again.payload == b"try again later"
            assert arrived >= due_earliest - 0.01
            fila.ack("retry", message_id)
        assert (fila.stats("retry").depth, fila.stats("retry").in_flight) == (0, 0)


def test_dead_lettered_message_survives_kill_9(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="sync")
    headers = {"tenant": "acme", "order": "42", "note": "h\u00e9llo"}
    payload = b"\x00\x01 binary \xff\xfe payload"
    with connect(server.addr) as fila:
        fila.create_queue("jobs", on_enqueue=ON_ENQUEUE_FIXED, on_failure=ON_FAILURE_DLQ)
        message_id = fila.enqueue("jobs", payload, headers)
        _lease_one(fila, "jobs", message_id)
        fila.nack("jobs", message_id, "fatal")
        assert (fila.stats("jobs.dlq").depth, fila.stats("jobs").depth) == (1, 0)
    server.kill()
    server.start()

    with connect(server.addr) as fila:
        assert fila.queue_names() == ["jobs", "jobs.dlq"]
        assert (fila.stats("jobs").depth, fila.stats("jobs").in_flight) == (0, 0)
        assert (fila.stats("jobs.dlq").depth, fila.stats("jobs.dlq").in_flight) == (1, 0)
        with fila.consume("jobs") as stream:
            _expect_nothing(stream, QUIET_S, "a dead-lettered message went back to its queue")
        with fila.consume("jobs.dlq") as stream:
            dead = stream.get(PROMPT_S)
            _expect_nothing(stream, 0.2, "the DLQ holds more than the one message")
        assert dead.id == message_id
        assert dict(dead.headers) == headers
        assert dead.payload == payload
        assert dead.metadata.attempt_count == 1
        assert (dead.metadata.fairness_key, dead.metadata.weight) == ("tenant-acme", 3)
        fila.ack("jobs.dlq", message_id)


# ---------------------------------------------------------------------------------------
# 5. A deleted queue stays deleted
# ---------------------------------------------------------------------------------------


def test_deleted_queue_stays_deleted_after_kill_9(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("doomed", on_failure=ON_FAILURE_BY_FATE)
        fila.create_queue("keeper")
        kept = fila.enqueue("keeper", b"keep me")
        # One message in each state the queue can hold: dead-lettered, delayed,
        # leased, ready.
        to_dlq = fila.enqueue("doomed", b"1", {"fate": "dlq"})
        to_delay = fila.enqueue("doomed", b"2", {"fate": "later"})
        to_lease = fila.enqueue("doomed", b"3")
        with fila.consume("doomed") as stream:
            got = {m.id: m for m in stream.take(3, timeout=PROMPT_S)}
        assert set(got) == {to_dlq, to_delay, to_lease}
        fila.nack("doomed", to_dlq, "dead")
        fila.nack("doomed", to_delay, "later")
        for i in range(3):
            fila.enqueue("doomed", f"ready {i}".encode())
        doomed, dlq = fila.stats("doomed"), fila.stats("doomed.dlq")
        assert (doomed.depth, doomed.in_flight, dlq.depth) == (4, 1, 1), "precondition"
        fila.delete_queue("doomed")
    server.kill()
    server.start()

    with connect(server.addr) as fila:
        assert fila.queue_names() == ["keeper", "keeper.dlq"]
        for name in ("doomed", "doomed.dlq"):
            request = admin_pb2.GetStatsRequest(queue=name)
            assert _code(fila.admin.GetStats, request) == grpc.StatusCode.NOT_FOUND
        assert fila.stats("keeper").depth == 1

        # Recreated, it is a new, empty queue with an empty DLQ.
        fila.create_queue("doomed")
        for name in ("doomed", "doomed.dlq"):
            stats = fila.stats(name)
            assert (stats.depth, stats.in_flight) == (0, 0), name
        with fila.consume("doomed") as stream:
            _expect_nothing(stream, QUIET_S, "a message of the deleted queue came back")
        with fila.consume("doomed.dlq") as stream:
            _expect_nothing(stream, 0.2, "a dead letter of the deleted queue came back")
        fresh = fila.enqueue("doomed", b"fresh")
    server.kill()
    server.start()

    # The recreated queue is as durable as any other, and holds only its own message.
    with connect(server.addr) as fila:
        assert fila.queue_names() == ["doomed", "doomed.dlq", "keeper", "keeper.dlq"]
        assert (fila.stats("doomed").depth, fila.stats("doomed.dlq").depth) == (1, 0)
        with fila.consume("doomed") as stream:
            assert stream.get(PROMPT_S).id == fresh
            fila.ack("doomed", fresh)
            _expect_nothing(stream, 0.2, "a message of the deleted queue came back")
        with fila.consume("keeper") as stream:
            assert stream.get(PROMPT_S).id == kept
