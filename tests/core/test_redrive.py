"""Dead letters and redrive: how messages move into `<queue>.dlq` and back.

SPEC 2: `{action="dlq"}` moves a message to its queue's DLQ, which keeps its id,
headers, payload and metadata and is an ordinary queue; `Redrive(dlq, count)` moves
up to `count` (0: all) messages that are not leased back to the queue, resetting
`attempt_count` to 0 and running `on_enqueue` again. Messages keep their place by id
both ways (SPEC 2, DRR: a key's messages are in enqueue order).
"""

from __future__ import annotations

import pytest
from support.core import CoreBroker, make_core, run_async

from fila.core.errors import InvalidArgument, QueueNotFound

ALWAYS_DLQ = 'function on_failure(m) return { action = "dlq" } end'
GENERATION = """
function on_enqueue(m)
  return { fairness_key = (m.headers.tenant or "t") .. "-" .. (fila.get("gen") or "g0") }
end
"""


async def _dead_lettering(core: CoreBroker, queue: str = "q", on_enqueue: str = "") -> None:
    await core.create_queue(queue, on_enqueue=on_enqueue, on_failure=ALWAYS_DLQ)


async def _dead_letter(core: CoreBroker, queue: str, message_ids: list[str]) -> None:
    """Delivers the messages and nacks them, last first: into the DLQ in reverse order."""
    consumer = await core.attach(queue, prefetch=len(message_ids), max_batch=len(message_ids))
    assert sorted(core.take(consumer)) == sorted(message_ids)
    for message_id in reversed(message_ids):
        assert await core.nack(queue, message_id, error="fatal") == [None]
    await core.detach(consumer)


@run_async
async def test_dead_letters_wait_in_the_dlq_in_id_order_whatever_order_they_failed_in() -> None:
    core = make_core()
    await _dead_lettering(core)
    ids = await core.enqueue("q", 3)
    await _dead_letter(core, "q", ids)
    assert core.depth("q") == (0, 0) and core.depth("q.dlq") == (3, 0)
    assert core.stats("q").counters.dead_lettered == 3
    dlq = await core.attach("q.dlq", prefetch=10, max_batch=10)
    assert core.take(dlq) == ids


@run_async
async def test_redrive_moves_some_then_the_rest_back_and_runs_on_enqueue_again() -> None:
    core = make_core()
    await _dead_lettering(core, on_enqueue=GENERATION)
    await core.set_config("gen", "g1")
    ids = await core.enqueue_each("q", [{"tenant": "acme"}] * 5)
    await _dead_letter(core, "q", ids)
    assert {m.metadata.fairness_key for m in core.peek("q.dlq")[0]} == {"acme-g1"}
    await core.set_config("gen", "g2")  # what on_enqueue reads changed meanwhile

    assert await core.redrive("q.dlq", 2) == 2
    assert core.depth("q.dlq") == (3, 0) and core.depth("q") == (2, 0)
    assert [(k.key, k.pending) for k in core.stats("q").per_key] == [("acme-g2", 2)]
    assert await core.redrive("q.dlq", 0) == 3
    assert core.depth("q.dlq") == (0, 0) and core.depth("q") == (5, 0)
    assert core.stats("q").counters.redriven == 5

    consumer = await core.attach("q", prefetch=10, max_batch=10)
    back = core.receive(consumer)
    assert [m.id for m in back] == ids
    for message in back:
        meta = message.metadata
        assert (meta.attempt_count, meta.queue_id, meta.fairness_key) == (0, "q", "acme-g2")
        assert dict(message.headers) == {"tenant": "acme"}
    assert await core.redrive("q.dlq", 0) == 0


@pytest.mark.parametrize("count", [10, 2**64 - 1])
@run_async
async def test_a_redrive_count_over_what_the_dlq_holds_moves_them_all(count: int) -> None:
    core = make_core()
    await _dead_lettering(core)
    ids = await core.enqueue("q", 2)
    await _dead_letter(core, "q", ids)
    assert await core.redrive("q.dlq", count) == 2
    assert core.depth("q") == (2, 0) and core.depth("q.dlq") == (0, 0)


@run_async
async def test_redrive_leaves_leased_dlq_messages_where_they_are() -> None:
    core = make_core()
    await _dead_lettering(core)
    leased = await core.enqueue("q", 2)
    await _dead_letter(core, "q", leased)
    dlq = await core.attach("q.dlq", prefetch=2, max_batch=2)
    assert core.take(dlq) == leased
    ready = await core.enqueue("q", 3)
    await _dead_letter(core, "q", ready)
    assert core.depth("q.dlq") == (3, 2)
    assert await core.redrive("q.dlq", 0) == 3
    assert core.depth("q.dlq") == (0, 2) and core.depth("q") == (3, 0)
    assert sorted(core.attempts("q")) == sorted(ready)
    assert await core.ack("q.dlq", *leased) == [None, None], "still leased in the DLQ"


@run_async
async def test_redriven_messages_take_their_old_place_ahead_of_newer_ones() -> None:
    core = make_core()
    await _dead_lettering(core)
    old = await core.enqueue("q", 2)
    await _dead_letter(core, "q", old)
    new = await core.enqueue("q", 2)
    assert await core.redrive("q.dlq") == 2
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert core.take(consumer) == old + new


@run_async
async def test_redrive_refuses_what_is_not_a_dlq_and_changes_nothing() -> None:
    core = make_core()
    await _dead_lettering(core)
    (dead,) = await core.enqueue("q")
    await _dead_letter(core, "q", [dead])
    await core.enqueue("q")
    with pytest.raises(InvalidArgument, match='"q" is not a dead-letter queue'):
        await core.redrive("q")
    for missing in ("nope", "nope.dlq"):
        with pytest.raises(QueueNotFound):
            await core.redrive(missing)
    with pytest.raises(InvalidArgument):
        await core.redrive("")
    assert core.depth("q") == (1, 0) and core.depth("q.dlq") == (1, 0)


@run_async
async def test_a_dead_letter_keeps_its_id_headers_payload_and_attempts() -> None:
    core = make_core()
    await _dead_lettering(core, on_enqueue=GENERATION)
    (message_id,) = await core.enqueue_each("q", [{"tenant": "acme", "trace": "é"}])
    (stored,) = core.peek("q")[0]
    await _dead_letter(core, "q", [message_id])
    (dead,) = core.peek("q.dlq")[0]
    assert (dead.id, dict(dead.headers), dead.payload) == (
        message_id,
        {"tenant": "acme", "trace": "é"},
        stored.payload,
    )
    assert (dead.metadata.attempt_count, dead.metadata.queue_id) == (1, "q.dlq")
    assert dead.metadata.fairness_key == "acme-g0"
    assert dead.timestamps.enqueued_at == stored.timestamps.enqueued_at
