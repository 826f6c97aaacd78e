"""The SDK's admin conveniences against a real broker, sync and async: create_queue's
`exist_ok`, peek (a page, paging, every page), purge, and the GetStats counters."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from support import unique, wait_until

from fila.testing.server import ServerProcess
from fila.v1 import service_pb2, service_pb2_grpc
from fila_sdk import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    PeekPage,
    QueueAlreadyExistsError,
    QueueNotFoundError,
)

TENANT_KEYS = 'function on_enqueue(m) return { fairness_key = m.headers.tenant or "none" } end'
DEAD_LETTER = 'function on_failure(m) return { action = "dlq" } end'
DEADLINE_S = 20.0


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.addr) as c:
        yield c


def _lease(client: Client, queue: str, count: int) -> list[str]:
    """Lease exactly `count` messages and keep them leased (the stream's prefetch).

    Returns once the broker has seen the stream go: until then an ack of one of these
    messages frees a prefetch slot, and the broker may fill it with one more delivery
    to the closing stream (a lease nobody holds, counted as delivered).
    """
    stub = service_pb2_grpc.FilaServiceStub(client._channel)
    call = stub.Consume(service_pb2.ConsumeRequest(queue=queue, prefetch=count))
    ids = [next(r for r in call if r.HasField("message")).message.id for _ in range(count)]
    call.cancel()
    wait_until(
        lambda: client.get_stats(queue).active_consumers == 0,
        DEADLINE_S,
        what=f"the broker to see the consumer of {queue} go",
    )
    return ids


def test_create_queue_exist_ok(client: Client) -> None:
    name = unique("exist")
    assert client.create_queue(name, visibility_timeout_ms=5000) == name
    with pytest.raises(QueueAlreadyExistsError):
        client.create_queue(name)
    assert client.create_queue(name, exist_ok=True) == name
    assert client.create_queue(name, on_enqueue=TENANT_KEYS, exist_ok=True) == name
    with pytest.raises(InvalidArgumentError):  # other errors still raise
        client.create_queue("bad name", exist_ok=True)


def test_peek_pages_and_filters_and_changes_nothing(client: Client) -> None:
    name = unique("peek")
    client.create_queue(name, on_enqueue=TENANT_KEYS)
    ids = [client.enqueue(name, {"tenant": "ab"[i % 2]}, f"m{i}".encode()) for i in range(5)]
    before = client.get_stats(name)

    page = client.peek(name)
    assert isinstance(page, PeekPage) and page.next_after_id is None
    assert [m.id for m in page.messages] == ids
    assert page.messages[0].payload == b"m0" and page.messages[0].headers == {"tenant": "a"}
    assert page.messages[0].queue == name and page.messages[0].leased_at is None

    first = client.peek(name, limit=2)
    assert [m.id for m in first.messages] == ids[:2] and first.next_after_id == ids[1]
    second = client.peek(name, limit=2, after_id=first.next_after_id)
    assert [m.id for m in second.messages] == ids[2:4]
    last = client.peek(name, limit=2, after_id=second.next_after_id)
    assert [m.id for m in last.messages] == ids[4:] and last.next_after_id is None

    assert [m.id for m in client.peek(name, fairness_key="b").messages] == ids[1::2]
    assert [m.id for m in client.peek_all(name, page_size=2)] == ids
    assert [m.id for m in client.peek_all(name, page_size=2, after_id=ids[2])] == ids[3:]
    assert [m.id for m in client.peek_all(name, fairness_key="a", page_size=1)] == ids[::2]

    after = client.get_stats(name)
    assert (after.depth, after.in_flight, after.delivered_total) == (
        before.depth,
        before.in_flight,
        before.delivered_total,
    )
    with pytest.raises(QueueNotFoundError):
        client.peek(unique("absent"))


def test_purge_counts_ready_and_delayed_and_keeps_leases(client: Client) -> None:
    name = unique("purge")
    client.create_queue(name)
    for i in range(3):
        client.enqueue(name, None, f"p{i}".encode())
    (leased,) = _lease(client, name, 1)
    assert client.purge(name) == 2
    assert [m.id for m in client.peek_all(name)] == [leased]
    client.ack(name, leased)
    assert client.purge(name) == 0
    with pytest.raises(QueueNotFoundError):
        client.purge(unique("absent"))


def test_stats_counters(client: Client) -> None:
    name = unique("count")
    client.create_queue(name, on_enqueue=TENANT_KEYS, on_failure=DEAD_LETTER)
    for tenant in ("a", "a", "b", "b"):
        client.enqueue(name, {"tenant": tenant}, b"x")
    first, second, _third = _lease(client, name, 3)
    client.ack(name, first)
    client.nack(name, second, "boom")  # dead-lettered by the hook
    stats = client.get_stats(name)
    assert stats.enqueued_total == 4
    assert stats.delivered_total == 3
    assert stats.acked_total == 1
    assert stats.nacked_total == 1
    assert stats.dead_lettered_total == 1
    assert stats.expired_total == 0
    delivered = {k.key: k.delivered_total for k in stats.per_key}
    # a key still in the ring reports its share of the deliveries
    assert delivered and all(v >= 1 for v in delivered.values()) and sum(delivered.values()) <= 3
    assert client.get_stats(f"{name}.dlq").depth == 1


def test_expired_counter(client: Client) -> None:
    name = unique("expire")
    client.create_queue(name, visibility_timeout_ms=200)
    client.enqueue(name, None, b"x")
    _lease(client, name, 1)
    wait_until(lambda: client.get_stats(name).expired_total == 1, DEADLINE_S)


def test_async_admin_conveniences(server: ServerProcess) -> None:
    async def scenario() -> None:
        name = unique("async")
        async with AsyncClient(server.addr) as client:
            assert await client.create_queue(name) == name
            assert await client.create_queue(name, exist_ok=True) == name
            with pytest.raises(QueueAlreadyExistsError):
                await client.create_queue(name)
            ids = [await client.enqueue(name, None, f"a{i}".encode()) for i in range(3)]
            page = await client.peek(name, limit=2)
            assert [m.id for m in page.messages] == ids[:2] and page.next_after_id == ids[1]
            assert [m.id async for m in client.peek_all(name, page_size=1)] == ids
            stats = await client.get_stats(name)
            assert stats.enqueued_total == 3 and stats.delivered_total == 0
            assert await client.purge(name) == 3
            assert (await client.peek(name)).messages == ()

    asyncio.run(scenario())
