"""The SDK's everyday forms against a real broker: `enqueue(queue, payload, headers=)`
beside the published `enqueue(queue, headers, payload)`, `str` payloads as UTF-8, the
JSON helpers, misuse refused in Fila's words before anything is sent; and the
Worker's rate-limited WARNING for a handler that raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from support import unique
from support.worker import wait

from fila.testing.server import ServerProcess
from fila_sdk import (
    ArgumentError,
    AsyncClient,
    Client,
    InvalidArgumentError,
    Message,
    Worker,
)
from fila_sdk.failure_log import BURST, FailureLog

RETRY_AT_ONCE = """
function on_failure(msg)
  return { action = "retry" }
end
"""


def _payloads(client: Client, queue: str) -> dict[str, tuple[bytes, dict[str, str]]]:
    return {m.id: (m.payload, m.headers) for m in client.peek_all(queue)}


def test_enqueue_takes_payload_first_or_the_published_order(server: ServerProcess) -> None:
    with Client(server.addr) as client:
        name = unique("forms")
        client.create_queue(name)
        ids = [
            client.enqueue(name, b"bytes first"),
            client.enqueue(name, "text é", headers={"tenant": "acme"}),
            client.enqueue(name, {"tenant": "globex"}, b"published order"),
            client.enqueue(name, None, "published, text"),
            client.enqueue(name, headers={"k": "v"}, payload=b"by name"),
            client.enqueue(name, {"k": "w"}, payload="headers by position"),
            client.enqueue_json(name, {"order": 7, "items": ["é"]}),
        ]
        stored = _payloads(client, name)
        assert [stored[i] for i in ids[:6]] == [
            (b"bytes first", {}),
            ("text é".encode(), {"tenant": "acme"}),
            (b"published order", {"tenant": "globex"}),
            (b"published, text", {}),
            (b"by name", {"k": "v"}),
            (b"headers by position", {"k": "w"}),
        ]
        json_message = next(m for m in client.peek_all(name) if m.id == ids[6])
        assert json_message.json() == {"order": 7, "items": ["é"]}
        assert json_message.headers == {"content-type": "application/json"}
        many = client.enqueue_many(name, ["one", (None, "two"), ({"a": "b"}, b"three")])
        assert [stored_payload for stored_payload, _ in map(_payloads(client, name).get, many)] == [  # type: ignore[misc]
            b"one",
            b"two",
            b"three",
        ]


def test_async_enqueue_takes_the_same_forms(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as client:
            name = unique("aforms")
            await client.create_queue(name)
            first = await client.enqueue(name, "text", headers={"h": "1"})
            second = await client.enqueue(name, None, b"published")
            third = await client.enqueue_json(name, [1, 2], headers={"Content-Type": "x/y"})
            page = await client.peek(name)
            found = {m.id: m for m in page.messages}
            assert (found[first].payload, found[first].headers) == (b"text", {"h": "1"})
            assert found[second].payload == b"published"
            assert found[third].json() == [1, 2]
            assert found[third].headers == {"Content-Type": "x/y"}  # the caller's type kept

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((None, 5), {}, "the payload must be bytes or str, not int"),
        (({"tenant": "acme"},), {}, "headers go after the payload"),
        (({"n": 1}, b"x"), {}, "header 'n' is str -> int"),
        (("not headers", b"x"), {}, "the headers must be a mapping of str to str, not str"),
        ((), {}, "enqueue needs a payload"),
        ((None, b"x"), {"payload": b"y"}, "both by position and by name"),
        ((None, b"x", b"y"), {}, "got 4 positional arguments"),
    ],
)
def test_enqueue_misuse_is_refused_in_filas_words_before_sending(
    server: ServerProcess, args: tuple[object, ...], kwargs: dict[str, object], words: str
) -> None:
    with Client(server.addr) as client:
        name = unique("misuse")
        client.create_queue(name)
        with pytest.raises(ArgumentError, match=words) as raised:
            client.enqueue(name, *args, **kwargs)  # type: ignore[call-overload]
        assert isinstance(raised.value, InvalidArgumentError)
        assert isinstance(raised.value, TypeError)
        with pytest.raises(ArgumentError, match="enqueue_many: the payload of item 1"):
            client.enqueue_many(name, [b"ok", (None, 5)])  # type: ignore[list-item]
        with pytest.raises(ArgumentError, match="is not JSON"):
            client.enqueue_json(name, {1, 2})
        assert client.get_stats(name).depth == 0  # nothing was sent


def test_failure_log_writes_a_burst_then_counts_what_it_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failures = FailureLog(logging.getLogger("fila_sdk"), "orders", clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="fila_sdk")
    for attempt in range(1, 1001):
        failures.failed(f"id-{attempt}", attempt, ValueError("boom"))
    assert len(caplog.records) == BURST
    assert failures.dropped == 1000 - BURST
    now[0] += 1.0  # one more line a second
    failures.failed("id-late", 7, KeyError("gone"))
    last = caplog.records[-1]
    assert len(caplog.records) == BURST + 1
    assert last.getMessage().startswith(
        "worker on 'orders': handler failed for message id-late (attempt 7): KeyError: 'gone'"
    )
    assert "990 more failures not logged" in last.getMessage()
    assert (last.queue, last.message_id, last.attempt, last.dropped_before) == (  # type: ignore[attr-defined]
        "orders",
        "id-late",
        7,
        990,
    )
    assert last.exc_info is not None and last.exc_info[0] is KeyError


def test_worker_logs_a_raising_handler_at_warning_without_flooding(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fila_sdk")
    handled = threading.Event()
    seen = {"count": 0}

    def handle(message: Message) -> None:
        seen["count"] += 1
        if seen["count"] >= 200:
            handled.set()
        raise RuntimeError(f"cannot charge card for {message.payload.decode()}")

    with Client(server.addr) as client:
        name = unique("loud")
        client.create_queue(name, on_failure=RETRY_AT_ONCE)  # a hot retry loop
        message_id = client.enqueue(name, b"order 9")
        with Worker(client, name, handle, concurrency=1):
            wait(handled.is_set, "200 failed attempts")
    lines = [r for r in caplog.records if "handler failed" in r.getMessage()]
    assert 1 <= len(lines) <= BURST + 2, len(lines)  # 200+ failures, a burst of lines
    first = lines[0]
    assert first.levelno == logging.WARNING
    assert first.getMessage() == (
        f"worker on {name!r}: handler failed for message {message_id} (attempt 1): "
        "RuntimeError: cannot charge card for order 9"
    )
    assert first.exc_info is not None and first.exc_info[0] is RuntimeError
