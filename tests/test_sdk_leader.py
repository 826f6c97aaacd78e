"""The SDK's following of cluster leader hints (`fila_sdk.leader`), against stand-in
brokers that play the nodes of a cluster, so that each rule is shown exactly:

- a refusal naming the owner (`x-fila-leader-addr`) is followed at once, over a
  channel opened with the client's credentials;
- two nodes that name each other make the consumer back off after `MAX_HOPS`
  redirects in a row, rather than spin;
- when the owner goes away the consumer starts again from the address it was given,
  which names the owner anew (here on another address), instead of waiting on the
  old owner's.

The same consumers against real nodes, including a `kill -9` of the owner, are in
`tests/test_cluster.py` (`test_the_sdk_follows_the_owner_and_survives_its_restart`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import grpc
import grpc.aio
import pytest
from support.sdk_fakes import FakeBroker, fake_broker

from fila.v1 import messages_pb2, service_pb2
from fila.wire import LEADER_ADDR_METADATA_KEY
from fila_sdk import AsyncClient, Client, PermissionDeniedError, leader, retry

QUEUE = "q"
DEADLINE_S = 10.0

# What one node does with the n-th (1-based) Consume it receives.
Script = Callable[[int, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]


def consume_handler(broker: FakeBroker, script: Script) -> Any:
    async def handle(
        request: service_pb2.ConsumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        broker.record("Consume", request, context)
        async for response in script(len(broker.of("Consume")), context):
            yield response

    return grpc.unary_stream_rpc_method_handler(
        handle,
        request_deserializer=service_pb2.ConsumeRequest.FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )


async def redirect(context: grpc.aio.ServicerContext[Any, Any], addr: str) -> None:
    """What a cluster node answers a Consume for a queue another node serves."""
    await context.abort(
        grpc.StatusCode.UNAVAILABLE,
        f"queue is served at {addr}: consume there",
        trailing_metadata=((LEADER_ADDR_METADATA_KEY, addr),),
    )


def delivery(message_id: str) -> service_pb2.ConsumeResponse:
    return service_pb2.ConsumeResponse(message=messages_pb2.Message(id=message_id))


@contextmanager
def nodes(count: int, scripts: Callable[[list[str]], list[Script]]) -> Iterator[list[FakeBroker]]:
    """`count` stand-in nodes; `scripts(addresses)` gives each its Consume script (the
    scripts may name the nodes' addresses, known once they listen)."""
    chosen: list[Script] = []

    def late(i: int) -> Script:
        def script(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            return chosen[i](n, context)

        return script

    with ExitStack() as stack:
        brokers = [
            stack.enter_context(
                fake_broker(lambda b, i=i: {"Consume": consume_handler(b, late(i))})
            )
            for i in range(count)
        ]
        chosen.extend(scripts([b.addr for b in brokers]))
        yield brokers


async def forever() -> None:
    """A stream that stays open until the client ends it."""
    await asyncio.Event().wait()


def test_a_redirect_is_followed_with_the_clients_credentials() -> None:
    def scripts(addrs: list[str]) -> list[Script]:
        async def home(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await redirect(context, addrs[1])
            yield None

        async def owner(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            yield delivery("m1")
            await forever()

        return [home, owner]

    with nodes(2, scripts) as (home, owner):
        client = Client(home.addr, api_key="secret")
        stream = client.consume(QUEUE)
        assert next(stream).id == "m1"
        assert [c.metadata["authorization"] for c in owner.of("Consume")] == ["Bearer secret"]
        assert len(home.of("Consume")) == 1
        assert list(client._leaders._stubs) == [owner.addr]  # one channel, kept
        client.close()
        assert list(stream) == []  # ends quietly, as without cluster mode
        assert client._leaders.stub(owner.addr) is client._leaders.home  # none opened again


def test_nodes_naming_each_other_make_the_consumer_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After MAX_HOPS redirects without a delivery the next one is a failure: the
    reconnect backoff runs once, and redirects are followed again after it."""
    calls_at_failure: list[int] = []
    brokers: list[FakeBroker] = []

    class Enough(Exception):
        pass

    class Counting(retry.Reconnector):
        def failed(self, error: Any) -> float:
            calls_at_failure.append(sum(len(b.of("Consume")) for b in brokers))
            if len(calls_at_failure) == 2:
                raise Enough  # ends the consumer, as BrokerUnreachableError would
            return super().failed(error)

    monkeypatch.setattr("fila_sdk.aio.Reconnector", Counting)

    def scripts(addrs: list[str]) -> list[Script]:
        def pointing_at(other: str) -> Script:
            async def script(
                n: int, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                await redirect(context, other)
                yield None

            return script

        return [pointing_at(addrs[1]), pointing_at(addrs[0])]

    async def consume(addr: str) -> None:
        async with AsyncClient(addr) as client:
            async for _ in client.consume(QUEUE):
                raise AssertionError("nothing is delivered")

    with nodes(2, scripts) as made:
        brokers.extend(made)
        with pytest.raises(Enough):
            asyncio.run(asyncio.wait_for(consume(made[0].addr), DEADLINE_S))
    hops = leader.MAX_HOPS
    assert calls_at_failure == [hops + 1, 2 * (hops + 1)]


def test_a_lost_owner_is_found_again_through_the_given_address() -> None:
    """The owner's stream fails without a hint (it went away): the consumer goes back
    to its own address, which now names another owner, and consumes there."""

    def scripts(addrs: list[str]) -> list[Script]:
        async def home(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await redirect(context, addrs[1] if n == 1 else addrs[2])
            yield None

        async def first(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            if n == 1:
                yield delivery("m1")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the owner went away")

        async def second(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            yield delivery("m2")
            await forever()

        return [home, first, second]

    async def take_two(addr: str) -> list[str]:
        async with AsyncClient(addr) as client:
            got: list[str] = []
            async for message in client.consume(QUEUE):
                got.append(message.id)
                if len(got) == 2:
                    return got
        raise AssertionError("the stream ended")

    with nodes(3, scripts) as (home, first, second):
        got = asyncio.run(asyncio.wait_for(take_two(home.addr), DEADLINE_S))
        assert got == ["m1", "m2"]
        assert [len(b.of("Consume")) for b in (home, first, second)] == [2, 1, 1]


def test_unary_errors_are_not_redirects() -> None:
    """Only an UNAVAILABLE refusal names an owner; other errors keep their meaning."""
    with nodes(1, lambda addrs: [_refuse(grpc.StatusCode.PERMISSION_DENIED, addrs[0])]) as (n,):
        client = Client(n.addr)
        with pytest.raises(PermissionDeniedError):
            next(client.consume(QUEUE))
        assert len(n.of("Consume")) == 1
        client.close()


def _refuse(code: grpc.StatusCode, addr: str) -> Script:
    async def script(n: int, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        await context.abort(code, "no", trailing_metadata=((LEADER_ADDR_METADATA_KEY, addr),))
        yield None

    return script
