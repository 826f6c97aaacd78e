"""The SDK's fast paths against a real broker: enqueue_many, the coalescing stream
enqueue (and its unary fallback), batched consume, ack_many / nack_many, ack
coalescing, extend_lease, delays, connections and channel options.

Counting tests (how many requests went out) use the client's own counters or a
stand-in server (`support.sdk_fakes`) that records what reached the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from support import ServerFactory, unique, wait_until
from support.sdk_fakes import batch_ids, fake_broker, numbered_ids, unary

from fila.testing.server import ServerProcess
from fila.v1 import service_pb2
from fila_sdk import (
    AsyncClient,
    Client,
    EnqueueItem,
    FilaError,
    InvalidArgumentError,
    Message,
    MessageNotFoundError,
    QueueNotFoundError,
)
from fila_sdk.batching import (
    MAX_ERROR_BYTES,
    TRUNCATED_MARK,
    EnqueueLike,
    bounded_error,
    chunks,
    entries,
)

DEADLINE_S = 10.0
MAX_PAYLOAD = 2048
LIMITS_TOML = f"[server]\nmax_message_bytes = {MAX_PAYLOAD}\n"
# on_failure that dead-letters only a nack whose error text is exactly "fatal: 42"
# (anything else retries), so a DLQ arrival proves the text reached the broker.
DLQ_ON_EXACT_TEXT = """
function on_failure(msg)
  if msg.error == "fatal: 42" then return { action = "dlq" } end
  return { action = "retry" }
end
"""


@pytest.fixture
def limited(server_factory: ServerFactory) -> ServerProcess:
    return server_factory(config_toml=LIMITS_TOML)


@pytest.fixture
def client(limited: ServerProcess) -> Iterator[Client]:
    with Client(limited.addr) as c:
        yield c


def take(client: Client, queue: str, count: int, **consume: Any) -> list[Message]:
    """`count` messages from a fresh consume stream (which then closes)."""
    out: list[Message] = []
    if count == 0:
        return out
    for message in client.consume(queue, **consume):
        out.append(message)
        if len(out) == count:
            break
    return out


async def atake(client: AsyncClient, queue: str, count: int, **consume: Any) -> list[Message]:
    out: list[Message] = []
    async with (
        asyncio.timeout(DEADLINE_S),
        contextlib.aclosing(client.consume(queue, **consume)) as stream,
    ):
        async for message in stream:
            out.append(message)
            if len(out) == count:
                break
    return out


# --- enqueue_many -------------------------------------------------------------------


def test_enqueue_many_gives_each_item_its_id_or_its_own_error(client: Client) -> None:
    name = unique("many")
    client.create_queue(name)
    items: list[EnqueueLike] = [
        b"plain",
        EnqueueItem({"k": "v"}, b"with headers"),
        EnqueueItem(None, b"x" * (MAX_PAYLOAD + 1)),  # over the broker's payload limit
        EnqueueItem({"n": "3"}, b"fourth"),
        ({"t": "pair"}, b"a (headers, payload) pair"),
        (None, b"a triple", 0.0),
    ]
    results = client.enqueue_many(name, items)
    assert len(results) == 6
    assert isinstance(results[2], InvalidArgumentError)
    ids = [results[i] for i in (0, 1, 3, 4, 5)]
    assert all(isinstance(r, str) and r for r in ids)
    assert client.get_stats(name).depth == 5  # the bad item stored nothing

    got = take(client, name, 5)
    assert [m.id for m in got] == ids  # request order is storage order
    assert [(m.headers, m.payload) for m in got] == [
        ({}, b"plain"),
        ({"k": "v"}, b"with headers"),
        ({"n": "3"}, b"fourth"),
        ({"t": "pair"}, b"a (headers, payload) pair"),
        ({}, b"a triple"),
    ]
    with pytest.raises(TypeError, match="EnqueueItem"):
        client.enqueue_many(name, [42])  # type: ignore[list-item]


def test_enqueue_many_to_a_missing_queue_fails_every_item_without_raising(
    client: Client,
) -> None:
    results = client.enqueue_many(unique("missing"), [b"a", b"b"])
    assert [type(r) for r in results] == [QueueNotFoundError, QueueNotFoundError]
    assert client.enqueue_many(unique("missing"), []) == []


def test_enqueue_many_checks_every_item_before_sending_any(client: Client) -> None:
    """A malformed item used to be found while its chunk was built, after the chunks
    before it were sent: the call raised, yet those messages were stored (with their
    ids lost, and stored again by a retry)."""
    malformed: list[object] = [
        (None, 12.5),  # a payload is bytes or str (sent as UTF-8)
        EnqueueItem(None, 12.5),  # type: ignore[arg-type]
        ({"k": 1}, b"a header value that is no str"),
        ([("k", "v")], b"headers that are no mapping"),
    ]
    for bad in malformed:
        with pytest.raises(TypeError, match="item 2"):
            entries([b"ok", b"ok", bad])  # type: ignore[list-item]

    name = unique("checked")
    client.create_queue(name)
    not_bytes: Any = (None, ["not bytes"])
    items: list[EnqueueLike] = [b"ok"] * 10_000 + [not_bytes]
    with pytest.raises(TypeError, match="item 10000"):
        client.enqueue_many(name, items)

    async def scenario() -> None:
        async with AsyncClient(client.settings.target) as c:
            with pytest.raises(TypeError, match="item 10000"):
                await c.enqueue_many(name, items)
            await c.enqueue_many(name, [b"after"])  # durable when it returns

    asyncio.run(scenario())
    assert client.get_stats(name).depth == 1  # only "after": nothing else was sent


def test_async_enqueue_many_over_several_chunks(limited: ServerProcess) -> None:
    """25,000 items is three requests at the 10,000-message budget, sent pipelined;
    every item gets a distinct id, in order, and every message is stored."""

    async def scenario() -> None:
        async with AsyncClient(limited.addr) as c:
            name = unique("amany")
            await c.create_queue(name)
            count = 25_000
            results = await c.enqueue_many(name, [b"%d" % i for i in range(count)])
            assert all(isinstance(r, str) for r in results)
            assert len(set(results)) == count
            assert results == sorted(results)  # UUIDv7 ids: storage order is item order
            assert (await c.get_stats(name)).depth == count
            mixed = await c.enqueue_many(
                name, [b"ok", EnqueueItem(None, b"x" * (MAX_PAYLOAD + 1)), b"ok"]
            )
            assert [type(r) for r in mixed] == [str, InvalidArgumentError, str]

    asyncio.run(scenario())


def test_chunks_respect_message_and_byte_budgets() -> None:
    assert list(chunks([1] * 7, max_messages=3, max_bytes=100)) == [
        range(0, 3),
        range(3, 6),
        range(6, 7),
    ]
    assert list(chunks([40, 40, 40, 10], max_messages=100, max_bytes=100)) == [
        range(0, 2),
        range(2, 4),
    ]
    # an item over the byte budget travels alone
    assert list(chunks([10, 500, 10], max_messages=100, max_bytes=100)) == [
        range(0, 1),
        range(1, 2),
        range(2, 3),
    ]
    assert list(chunks([], max_messages=3, max_bytes=100)) == []


def test_enqueue_many_sends_one_request_per_chunk() -> None:
    with fake_broker(
        lambda b: {
            "EnqueueBatch": unary("EnqueueBatch", service_pb2.EnqueueBatchRequest, batch_ids, b)
        }
    ) as fake:
        with Client(fake.addr) as c:
            results = c.enqueue_many("q", [b"x"] * 12_345)
        assert len(results) == 12_345
        sizes = [len(call.request.messages) for call in fake.of("EnqueueBatch")]
        assert sorted(sizes) == [2_345, 10_000]  # pipelined: they may arrive in any order


# --- coalesced enqueue over StreamEnqueue --------------------------------------------


def test_concurrent_enqueues_share_requests_and_keep_their_own_results(
    limited: ServerProcess,
) -> None:
    async def scenario() -> None:
        async with AsyncClient(limited.addr) as c:
            name = unique("coal")
            await c.create_queue(name)
            payloads = [b"%d" % i for i in range(500)]
            calls = [c.enqueue(name, {"i": str(i)}, p) for i, p in enumerate(payloads)]
            calls.insert(250, c.enqueue(unique("missing"), None, b"lost"))
            calls.insert(100, c.enqueue(name, None, b"x" * (MAX_PAYLOAD + 1)))
            results = await asyncio.gather(*calls, return_exceptions=True)
            producer = c._producer
            assert producer is not None
            assert producer.requests_sent <= 3, producer.requests_sent
            assert isinstance(results.pop(251), QueueNotFoundError)
            assert isinstance(results.pop(100), InvalidArgumentError)
            assert all(isinstance(r, str) for r in results)
            assert len(set(results)) == 500
            got = await atake(c, name, 500, prefetch=500, max_batch=100)
            by_id = {m.id: m for m in got}
            assert [by_id[r].payload for r in results] == payloads  # type: ignore[index]

    asyncio.run(scenario())


def test_a_lone_enqueue_is_sent_on_the_next_turn_of_the_loop(limited: ServerProcess) -> None:
    """No timer: a single caller's request is written after the loop has run what was
    ready, not after some delay. A timer-based flush would still be waiting here."""

    async def scenario() -> None:
        async with AsyncClient(limited.addr) as c:
            name = unique("lone")
            await c.create_queue(name)
            await c.enqueue(name, None, b"warm the stream up")
            producer = c._producer
            assert producer is not None
            before = producer.requests_sent
            task = asyncio.create_task(c.enqueue(name, None, b"alone"))
            for _ in range(3):
                await asyncio.sleep(0)
            assert producer.requests_sent == before + 1
            started = time.perf_counter()
            assert await task
            # and it is answered as fast as a round trip, sequentially, 20 times
            for i in range(20):
                await c.enqueue(name, None, b"%d" % i)
            per_call = (time.perf_counter() - started) / 21
            assert per_call < 0.25, per_call

    asyncio.run(scenario())


def test_sync_enqueue_from_many_threads(limited: ServerProcess) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with Client(limited.addr) as c:
        name = unique("threads")
        c.create_queue(name)
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda i: c.enqueue(name, None, b"%d" % i), range(400)))
        assert len(set(ids)) == 400
        with pytest.raises(QueueNotFoundError):
            c.enqueue(unique("missing"), None, b"x")
        assert c.get_stats(name).depth == 400


def test_enqueue_falls_back_to_unary_against_a_broker_without_streams() -> None:
    def handlers(b: Any) -> dict[str, Any]:
        return {"Enqueue": unary("Enqueue", service_pb2.EnqueueRequest, numbered_ids, b)}

    with fake_broker(handlers) as fake:

        async def scenario() -> None:
            async with AsyncClient(fake.addr, api_key="k1") as c:
                ids = await asyncio.gather(*(c.enqueue("q", {"n": str(i)}, b"p") for i in range(5)))
                assert sorted(ids) == [f"u{i}" for i in range(1, 6)]
                producer = c._producer
                assert producer is not None and producer.unary_only
                assert await c.enqueue("q", None, b"after", delay=1.5) == "u6"

        asyncio.run(scenario())
        with Client(fake.addr) as sync:
            assert sync.enqueue("q", None, b"sync") == "u7"
            assert sync.enqueue("q", None, b"sync") == "u8"
        calls = fake.of("Enqueue")
        assert len(calls) == 8
        assert calls[0].metadata.get("authorization") == "Bearer k1"
        assert sorted(c.request.headers["n"] for c in calls[:5]) == ["0", "1", "2", "3", "4"]
        assert calls[5].request.delay_ms == 1500


def test_enqueue_delay(limited: ServerProcess) -> None:
    with Client(limited.addr) as c:
        name = unique("delay")
        c.create_queue(name)
        with pytest.raises(ValueError, match="delay"):
            c.enqueue(name, None, b"x", delay=-1)
        stored = time.monotonic()
        later = c.enqueue(name, None, b"later", delay=timedelta(milliseconds=700))
        sooner = c.enqueue(name, None, b"sooner", delay=0.3)
        results = c.enqueue_many(name, [EnqueueItem(None, b"batched", delay=0.5)])
        assert c.get_stats(name).depth == 3  # delayed messages count in depth
        got = take(c, name, 3)
        assert [m.id for m in got] == [sooner, results[0], later]
        # the last one cannot have been delivered before its delay ran out
        assert time.monotonic() - stored >= 0.7


# --- consume with prefetch and max_batch --------------------------------------------


def test_batched_consume_yields_every_message_of_each_frame(limited: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(limited.addr) as c:
            name = unique("bcons")
            await c.create_queue(name)
            ids = await c.enqueue_many(name, [b"%d" % i for i in range(60)])
            got = await atake(c, name, 60, prefetch=60, max_batch=25)
            assert [m.id for m in got] == ids
            assert [m.payload for m in got] == [b"%d" % i for i in range(60)]
            assert all(m.leased_at is not None and m.queue == name for m in got)

    asyncio.run(scenario())


def test_prefetch_bounds_what_a_consumer_holds(client: Client) -> None:
    name = unique("pref")
    client.create_queue(name)
    client.enqueue_many(name, [b"x"] * 30)
    stream = client.consume(name, prefetch=7, max_batch=5)
    first = next(stream)
    # The broker leases a stream its whole allowance in one go: once 7 are out, more
    # would already be (the in-process tests pin the bound exactly).
    wait_until(lambda: client.get_stats(name).in_flight >= 7, DEADLINE_S)
    assert client.get_stats(name).in_flight == 7
    client.ack(name, first.id)
    rest = [next(stream) for _ in range(7)]  # 6 held + 1 sent after the ack freed a slot
    assert len({m.id for m in rest}) == 7
    stream.close()
    with pytest.raises(ValueError, match="prefetch"):
        client.consume(name, prefetch=0)


# --- ack_many, nack_many, ack coalescing --------------------------------------------


def test_ack_many_and_nack_many_report_each_item(client: Client) -> None:
    name = unique("settle")
    client.create_queue(name, on_failure=DLQ_ON_EXACT_TEXT)
    client.enqueue_many(name, [b"%d" % i for i in range(6)])
    got = take(client, name, 6, prefetch=10, max_batch=10)
    bogus = str(uuid.uuid4())
    acked = client.ack_many(name, [got[0].id, bogus, got[1].id])
    assert acked[0] is None and acked[2] is None
    assert isinstance(acked[1], MessageNotFoundError) and bogus in acked[1].message
    nacked = client.nack_many(
        name, [got[2].id, (got[3].id, "fatal: 42"), got[0].id], error="transient"
    )
    assert nacked[0] is None and nacked[1] is None
    assert isinstance(nacked[2], MessageNotFoundError)  # acked above
    assert isinstance(client.ack_many(unique("missing"), [got[4].id])[0], QueueNotFoundError)
    assert client.ack_many(name, []) == []
    assert client.get_stats(f"{name}.dlq").depth == 1  # the "fatal: 42" one, by its text
    again = take(client, name, 1)[0]
    assert (again.id, again.attempt_count) == (got[2].id, 1)


def test_nack_error_text_is_bounded() -> None:
    assert bounded_error("short") == "short"
    assert bounded_error("e" * MAX_ERROR_BYTES) == "e" * MAX_ERROR_BYTES
    for text in ("E" * 20_000_000, "\u00e9" * MAX_ERROR_BYTES, "\U0001f600" * 300 + "x"):
        cut = bounded_error(text)
        assert len(cut.encode()) <= MAX_ERROR_BYTES and cut.endswith(TRUNCATED_MARK)
        assert text.startswith(cut[: -len(TRUNCATED_MARK)])  # no half character
        assert len(cut.encode()) > MAX_ERROR_BYTES - len(TRUNCATED_MARK) - 4
        assert bounded_error(cut) == cut


def test_a_huge_nack_text_is_cut_on_every_nack_path(client: Client) -> None:
    """A nack text over the broker's 16 MiB request limit failed the request and
    every settlement in it; the SDK cuts it wherever a nack is sent."""
    name = unique("huge")
    client.create_queue(name, on_failure=DLQ_ON_EXACT_TEXT)  # any other text retries
    client.enqueue_many(name, [b"%d" % i for i in range(4)])
    got = take(client, name, 4, prefetch=10, max_batch=10)
    huge = "E" * 20_000_000
    assert client.nack_many(name, [(got[0].id, huge)]) == [None]
    assert client.nack_many(name, [got[1].id], error=huge) == [None]
    client.nack(name, got[2].id, huge)

    async def scenario() -> None:
        async with AsyncClient(client.settings.target) as c:
            await c.nack(name, got[3].id, huge)

    asyncio.run(scenario())
    assert _counts(client, name) == (4, 0)


def _counts(client: Client, name: str) -> tuple[int, int]:
    stats = client.get_stats(name)
    return stats.depth, stats.in_flight


def test_async_ack_many_nack_many_and_coalesced_ack(limited: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(limited.addr) as c:
            name = unique("asettle")
            await c.create_queue(name, on_failure=DLQ_ON_EXACT_TEXT)
            await c.enqueue_many(name, [b"%d" % i for i in range(210)])
            got = await atake(c, name, 210, prefetch=300, max_batch=100)
            results = await c.ack_many(name, [m.id for m in got[:5]] + ["not-an-id"])
            assert results[:5] == [None] * 5
            assert isinstance(results[5], MessageNotFoundError)
            assert await c.nack_many(name, [(got[5].id, "fatal: 42")]) == [None]

            batches: list[int] = []
            send = c._send_acks

            async def counting(items: list[tuple[str, str]]) -> Any:
                batches.append(len(items))
                return await send(items)

            c._send_acks = counting  # type: ignore[method-assign]
            await asyncio.gather(*(c.ack(name, m.id) for m in got[6:206]))
            assert sum(batches) == 200 and len(batches) <= 2, batches
            with pytest.raises(MessageNotFoundError):
                await c.ack(name, got[6].id)  # each caller gets its own error

            # a lone ack is sent within a few turns of the loop (the task starts, the
            # flush runs, the send starts): no timer holds it back
            lone = asyncio.create_task(c.ack(name, got[206].id))
            before = len(batches)
            for _ in range(3):
                await asyncio.sleep(0)
            assert len(batches) == before + 1
            await lone
            outcome = await asyncio.gather(
                c.nack(name, got[207].id, "fatal: 42"),
                c.nack(name, "bogus"),
                return_exceptions=True,
            )
            assert outcome[0] is None and isinstance(outcome[1], MessageNotFoundError)
            assert (await c.get_stats(f"{name}.dlq")).depth == 2
            assert (await c.get_stats(name)).in_flight == 2  # got[208:210]

    asyncio.run(scenario())


# --- extend_lease -------------------------------------------------------------------


def test_extend_lease_keeps_a_message_past_its_visibility_timeout(
    server: ServerProcess,
) -> None:
    with Client(server.addr) as c:
        name = unique("extend")
        c.create_queue(name, visibility_timeout_ms=500)
        msg_id = c.enqueue(name, None, b"long job")
        c.enqueue(name, None, b"control: leased with it, not extended")
        message, _control = take(c, name, 2)
        assert message.id == msg_id
        deadline = c.extend_lease(name, message.id, timedelta(seconds=30))
        assert deadline.tzinfo is not None
        assert abs((deadline - datetime.now(UTC)).total_seconds() - 30) < 1.0
        # The control's lease runs out on the broker's clock; the extended one is kept.
        wait_until(lambda: c.get_stats(name).expired_total >= 1, DEADLINE_S)
        stats = c.get_stats(name)
        assert (stats.in_flight, stats.depth) == (1, 1), "the extended lease expired"
        default = c.extend_lease(name, message.id)  # None: the queue's 500 ms again
        assert (default - datetime.now(UTC)).total_seconds() < 1.0
        c.ack(name, msg_id)
        with pytest.raises(MessageNotFoundError):
            c.extend_lease(name, msg_id, 1)

    async def scenario() -> None:
        async with AsyncClient(server.addr) as ac:
            with pytest.raises(QueueNotFoundError):
                await ac.extend_lease(unique("missing"), msg_id)
            with pytest.raises(MessageNotFoundError):
                await ac.extend_lease(name, msg_id, timedelta(seconds=1))

    asyncio.run(scenario())


# --- connections and channel options ------------------------------------------------


def test_connections_spread_batch_calls_and_channel_options_apply() -> None:
    def handlers(b: Any) -> dict[str, Any]:
        return {
            "EnqueueBatch": unary("EnqueueBatch", service_pb2.EnqueueBatchRequest, batch_ids, b)
        }

    with fake_broker(handlers) as fake:
        options = [("grpc.primary_user_agent", "fila-test-agent")]

        async def scenario() -> None:
            async with AsyncClient(fake.addr, connections=3, channel_options=options) as c:
                for _ in range(6):
                    assert await c.enqueue_many("q", [b"x"]) == ["b0"]

        asyncio.run(scenario())
        with Client(fake.addr, connections=2) as sync:
            for _ in range(4):
                sync.enqueue_many("q", [b"x"])
        calls = fake.of("EnqueueBatch")
        assert len({c.peer for c in calls[:6]}) == 3  # three TCP connections, round-robin
        assert len({c.peer for c in calls[6:]}) == 2
        assert all("fila-test-agent" in c.metadata["user-agent"] for c in calls[:6])
    with pytest.raises(ValueError, match="connections"):
        Client("localhost:1", connections=0)


def test_two_clients_to_one_address_do_not_share_a_connection() -> None:
    """gRPC would put both on one TCP connection, so a Client made after a broker restart
    inherited the other's reconnect backoff and failed its first call."""

    def handlers(b: Any) -> dict[str, Any]:
        return {
            "EnqueueBatch": unary("EnqueueBatch", service_pb2.EnqueueBatchRequest, batch_ids, b)
        }

    with fake_broker(handlers) as fake:
        with Client(fake.addr) as first, Client(fake.addr) as second:
            first.enqueue_many("q", [b"x"])
            second.enqueue_many("q", [b"x"])

        async def scenario() -> None:
            async with AsyncClient(fake.addr) as third, AsyncClient(fake.addr) as fourth:
                await third.enqueue_many("q", [b"x"])
                await fourth.enqueue_many("q", [b"x"])

        asyncio.run(scenario())
        peers = [c.peer for c in fake.of("EnqueueBatch")]
        assert len(peers) == len(set(peers)) == 4


def test_results_are_typed_errors_rooted_at_fila_error(client: Client) -> None:
    results = client.enqueue_many(unique("missing"), [b"x"])
    assert isinstance(results[0], FilaError) and "not found" in results[0].message
