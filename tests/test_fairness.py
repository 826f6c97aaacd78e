"""DRR fairness over the wire: a quiet tenant next to a noisy one.

The wiring check: a real broker takes fairness keys from `on_enqueue` and a raw
`Consume` stream receives in DRR order. DRR's behaviour (the SPEC's shares for any
weights and quantum, FIFO per key, the ring) is specified in-process, in
tests/core/test_fairness.py and tests/test_drr.py.
"""

from __future__ import annotations

from support import ServerProcess
from support.stubs import connect

TENANT_SCRIPT = (
    "function on_enqueue(m) "
    "return {fairness_key=m.headers.tenant, weight=tonumber(m.headers.w)} end"
)


def test_quiet_tenant_is_not_stuck_behind_noisy_backlog(server: ServerProcess) -> None:
    with connect(server.addr) as f:
        f.create_queue("mixed", on_enqueue=TENANT_SCRIPT)
        noisy = [f.enqueue("mixed", b"n", {"tenant": "noisy", "w": "1"}) for _ in range(100)]
        quiet = [f.enqueue("mixed", b"q", {"tenant": "quiet", "w": "1"}) for _ in range(5)]
        with f.consume("mixed") as stream:
            got = stream.take(105, timeout=20.0, ack=True)
    order = [m.id for m in got]
    assert sorted(order) == sorted(noisy + quiet)
    quiet_positions = [order.index(q) for q in quiet]
    # Equal weights: DRR alternates the two keys, so the 5 quiet messages are spread
    # over the first ~10 deliveries (allowing one extra noisy turn at the start).
    assert max(quiet_positions) <= 11, quiet_positions
    # And in their own order.
    assert quiet_positions == sorted(quiet_positions)
