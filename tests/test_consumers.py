"""Several consumers on one queue: spreading, exactly-once, slow and vanished consumers, keepalive.

The broker runs as a real process; consumers are raw `Consume` streams read by
background threads (`support.stubs.ConsumeStream`), and a vanished client is a
real child process killed with SIGKILL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from support import ServerFactory, ServerProcess, wait_until
from support.stubs import ConsumeStream, Fila, connect

from fila.config import Config
from fila.v1 import messages_pb2, service_pb2

# Messages the broker may push ahead to one stream before its client reads them
# (`[scheduler] consumer_buffer`, default). A consumer that stops reading, or goes
# away, may hold at most about this many messages hostage until their visibility
# timeout; allow twice that for what sits in the transport.
CONSUMER_BUFFER = Config().scheduler.consumer_buffer
HOLD_ALLOWANCE = 2 * CONSUMER_BUFFER


def _ms(stamp: object) -> int:
    return int(stamp.seconds) * 1000 + int(stamp.nanos) // 1_000_000  # type: ignore[attr-defined]


def _drain(
    f: Fila,
    streams: list[ConsumeStream],
    until: int,
    timeout: float,
    *,
    ack: bool = True,
) -> dict[int, list[messages_pb2.Message]]:
    """Collects (and acks) from every stream until `until` messages in total arrived.

    Returns what each stream got, by index, possibly fewer than `until` in total if
    `timeout` seconds passed first: the caller asserts on the counts.
    """
    got: dict[int, list[messages_pb2.Message]] = {i: [] for i in range(len(streams))}
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in got.values()) < until and time.monotonic() < deadline:
        progressed = False
        for i, stream in enumerate(streams):
            for message in stream.poll():
                progressed = True
                got[i].append(message)
                if ack:
                    f.ack(stream.queue_name, message.id)
        if not progressed:
            time.sleep(0.005)  # pacing only; the loop is bounded by the deadline above
    return got


def test_consumers_share_the_queue_and_get_every_message_exactly_once(
    server: ServerProcess,
) -> None:
    total = 90
    with connect(server.addr) as f:
        f.create_queue("shared")
        streams = [f.consume("shared") for _ in range(3)]
        try:
            wait_until(lambda: f.stats("shared").active_consumers == 3, 5.0)
            ids = {f.enqueue("shared", f"m{i}".encode()) for i in range(total)}
            got = _drain(f, streams, total, 20.0)
            every = [m for messages in got.values() for m in messages]
            assert len(every) == total, {i: len(v) for i, v in got.items()}
            counts = Counter(m.id for m in every)
            assert set(counts) == ids
            duplicates = {i: n for i, n in counts.items() if n > 1}
            assert not duplicates, duplicates
            assert all(m.metadata.attempt_count == 0 for m in every)
            # Spread across the consumers, not all to one of them.
            per_stream = [len(got[i]) for i in range(3)]
            assert min(per_stream) >= total // 3 // 3, per_stream
        finally:
            for stream in streams:
                stream.cancel()
        stats = f.stats("shared")
        assert (stats.depth, stats.in_flight) == (0, 0)


@pytest.mark.parametrize("backlog_first", [True, False], ids=["backlog", "live"])
def test_slow_consumer_does_not_stall_a_fast_one(
    server: ServerProcess, backlog_first: bool
) -> None:
    """A stream that reads one message and then stops reading must not sit on the rest."""
    total = 200
    payload = b"x" * 1024
    with connect(server.addr) as f:
        # Leases far longer than the test: only the scheduler can hand messages over.
        f.create_queue("work", visibility_timeout_ms=60_000)
        if backlog_first:
            ids = {f.enqueue("work", payload) for _ in range(total)}
        slow = f.consume("work", read_limit=1)
        try:
            if backlog_first:
                slow.get()
                fast = f.consume("work")
            else:
                fast = f.consume("work")
                wait_until(lambda: f.stats("work").active_consumers == 2, 5.0)
                ids = {f.enqueue("work", payload) for _ in range(total)}
                slow.get()
            try:
                # The fast consumer gets everything except what the slow one may hold.
                want = total - 1 - HOLD_ALLOWANCE
                got = _drain(f, [fast], want, 5.0)[0]
                n_fast = len(got)
                assert n_fast >= want, (
                    f"the fast consumer got {n_fast} of {total} messages in 5 s; the slow "
                    f"stream, which read 1, holds {f.stats('work').in_flight} leased messages"
                )
                assert {m.id for m in got} <= ids

                # The rest is held by the slow stream (bounded), not lost or stuck. The fast
                # one keeps acking: with the slow stream holding a full prefetch, what is
                # left can be one more than the fast stream's own prefetch.
                def drained() -> bool:
                    got.extend(_drain(f, [fast], total, 0.05)[0])
                    return f.stats("work").depth == 0

                wait_until(drained, 5.0, what="queue drained")
                held = f.stats("work").in_flight
                got += _drain(f, [fast], total - held - len(got), 5.0)[0]
                assert len({m.id for m in got}) == len(got)
                assert len(got) + held == total
                assert held <= 1 + HOLD_ALLOWANCE, held
            finally:
                fast.cancel()
        finally:
            slow.cancel()


def test_disconnected_consumer_gives_back_unsent_at_once_and_received_after_timeout(
    server: ServerProcess,
) -> None:
    timeout_ms = 2_000
    total = 100
    read_by_first = 3
    with connect(server.addr) as f:
        f.create_queue("handoff", visibility_timeout_ms=timeout_ms)
        ids = {f.enqueue("handoff", b"y" * 1024) for _ in range(total)}

        first = f.consume("handoff", read_limit=read_by_first)
        received = first.take(read_by_first)
        first_leased = {m.id: _ms(m.timestamps.leased_at) for m in received}
        # The broker leases a consumer what its buffer holds at once, and no more until
        # it settles: a client that stopped reading holds exactly consumer_buffer.
        wait_until(
            lambda: f.stats("handoff").in_flight >= CONSUMER_BUFFER,
            5.0,
            what="the first consumer's buffer is filled",
        )
        assert f.stats("handoff").in_flight == CONSUMER_BUFFER
        first.cancel()
        wait_until(
            lambda: f.stats("handoff").active_consumers == 0,
            5.0,
            what="the cancelled stream is no longer a consumer",
        )

        second = f.consume("handoff")
        try:
            got = _drain(f, [second], total, 10.0)[0]
        finally:
            second.cancel()
        n_got = len(got)
        assert n_got == total, f"the second consumer got {n_got} of {total} in 10 s"

    assert Counter(m.id for m in got) == Counter(ids)  # every message exactly once
    by_id = {m.id: m for m in got}
    # What the first consumer read comes back only after its lease ran out, as a retry.
    for message_id, leased_ms in first_leased.items():
        again = by_id[message_id]
        assert again.metadata.attempt_count == 1, message_id
        assert _ms(again.timestamps.leased_at) >= leased_ms + timeout_ms
    # What it never got goes back at once: delivered fresh, before those leases expired.
    lease_end = min(first_leased.values()) + timeout_ms
    fresh = [m for m in got if m.metadata.attempt_count == 0]
    assert all(_ms(m.timestamps.leased_at) < lease_end for m in fresh)
    assert len(fresh) >= total - read_by_first - HOLD_ALLOWANCE, (
        f"only {len(fresh)} of {total} messages reached the second consumer before the "
        f"first consumer's leases expired; the rest were held by a stream that was gone"
    )


_VANISHING_CLIENT = """
import sys
import grpc
from fila.v1 import service_pb2, service_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
stream = service_pb2_grpc.FilaServiceStub(channel).Consume(
    service_pb2.ConsumeRequest(queue=sys.argv[2]))
print("open", flush=True)
for frame in stream:
    pass
"""


def test_active_consumers_back_to_zero_after_disconnect(
    server: ServerProcess, tmp_path: Path
) -> None:
    with connect(server.addr) as f:
        f.create_queue("watch")
        streams = [f.consume("watch") for _ in range(3)]
        wait_until(lambda: f.stats("watch").active_consumers == 3, 5.0)
        assert {q.name: q.active_consumers for q in f.list_queues().queues}["watch"] == 3
        streams[0].cancel()
        wait_until(lambda: f.stats("watch").active_consumers == 2, 5.0)
        for stream in streams[1:]:
            stream.cancel()
        wait_until(lambda: f.stats("watch").active_consumers == 0, 5.0)

        # A client process that dies without closing anything (SIGKILL) is noticed too.
        script = tmp_path / "vanish.py"
        script.write_text(_VANISHING_CLIENT, encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        client = subprocess.Popen(
            [sys.executable, str(script), server.addr, "watch"],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert client.stdout is not None
            assert client.stdout.readline().strip() == b"open"
            wait_until(lambda: f.stats("watch").active_consumers == 1, 10.0)
            message_id = f.enqueue("watch", b"for the doomed client")
            wait_until(lambda: f.stats("watch").in_flight == 1, 5.0)
        finally:
            client.kill()
            client.wait()
        wait_until(
            lambda: f.stats("watch").active_consumers == 0,
            5.0,
            what="a killed client's stream is detached",
        )
        # The message it was sent is still leased; nothing was lost or duplicated.
        stats = f.stats("watch")
        assert stats.depth + stats.in_flight == 1
        assert message_id


KEEPALIVE_MS = 300


def test_idle_stream_gets_keepalive_frames_and_still_delivers(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(config_toml=f"[scheduler]\nkeepalive_ms = {KEEPALIVE_MS}\n")
    with connect(server.addr) as f:
        f.create_queue("idle")
        with f.consume("idle") as stream:
            wait_until(
                lambda: stream.keepalives >= 2,
                KEEPALIVE_MS / 1000 * 2 + 10.0,
                interval=0.1,
                what="a keepalive frame on an idle stream",
            )
            empty = stream.frames[0]
            assert not empty.HasField("message")
            assert empty == service_pb2.ConsumeResponse()
            assert empty.SerializeToString() == b""
            # Skipping the keepalive (as the published clients do), the stream still works.
            message_id = f.enqueue("idle", b"after keepalive")
            msg = stream.get()
            assert (msg.id, msg.payload, msg.metadata.attempt_count) == (
                message_id,
                b"after keepalive",
                0,
            )
            assert stream.error is None
