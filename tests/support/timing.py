"""Timestamped consumers and process probes for the policy, throttle and Lua tests.

`TimedConsumer` reads one raw `Consume` stream on a thread and stamps every
delivered message with `time.monotonic()` the moment it arrives, so tests can
measure delays and rates from the client's side (what a user would observe).
With `auto_ack=True` it acks each message right away on the same thread: a
consumer that acks as fast as it can.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from fila.v1 import messages_pb2, service_pb2, service_pb2_grpc

_END = object()


class TimedConsumer:
    def __init__(
        self,
        channel: grpc.Channel,
        queue_name: str,
        *,
        auto_ack: bool = False,
    ) -> None:
        self.queue_name = queue_name
        self._svc = service_pb2_grpc.FilaServiceStub(channel)
        self.auto_ack = auto_ack
        self.started_at = time.monotonic()
        self.call = self._svc.Consume(service_pb2.ConsumeRequest(queue=queue_name))
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._log: list[tuple[float, messages_pb2.Message]] = []
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for frame in self.call:
                if not frame.HasField("message"):
                    continue  # keepalive
                now = time.monotonic()
                message = frame.message
                with self._lock:
                    self._log.append((now, message))
                self._inbox.put((now, message))
                if self.auto_ack:
                    self._svc.Ack(
                        service_pb2.AckRequest(queue=self.queue_name, message_id=message.id),
                        timeout=10.0,
                    )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        except BaseException as exc:
            self.error = exc
        finally:
            self._inbox.put(_END)

    # ------------------------------------------------------------------ reading

    def get(self, timeout: float = 5.0) -> tuple[float, messages_pb2.Message]:
        """(arrival time, message) of the next delivery; TimeoutError if none in time."""
        try:
            item = self._inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise TimeoutError(f"no message on {self.queue_name!r} within {timeout:.2f}s") from None
        if item is _END:
            self._inbox.put(_END)
            raise RuntimeError(f"consume stream on {self.queue_name!r} ended: {self.error!r}")
        arrival, message = item
        return arrival, message

    def take(self, count: int, timeout: float = 10.0) -> list[messages_pb2.Message]:
        """Exactly `count` more messages within `timeout` seconds in total."""
        deadline = time.monotonic() + timeout
        out: list[messages_pb2.Message] = []
        while len(out) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"got {len(out)} of {count} messages on {self.queue_name!r} within {timeout}s"
                )
            try:
                out.append(self.get(remaining)[1])
            except TimeoutError:
                continue
        return out

    def log(self) -> list[tuple[float, messages_pb2.Message]]:
        """Every delivery so far as (arrival time, message), in arrival order."""
        with self._lock:
            return list(self._log)

    def count(self) -> int:
        with self._lock:
            return len(self._log)

    def arrivals_between(
        self, start: float, end: float
    ) -> list[tuple[float, messages_pb2.Message]]:
        return [(t, m) for t, m in self.log() if start <= t <= end]

    def wait_count(self, n: int, timeout: float) -> float:
        """Waits until at least `n` messages arrived; returns the arrival time of the n-th."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log()
            if len(log) >= n:
                return log[n - 1][0]
            if self.error is not None:
                raise RuntimeError(f"consume stream failed: {self.error!r}")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{len(log)} of {n} messages on {self.queue_name!r} within {timeout}s"
                )
            time.sleep(0.005)

    def cancel(self) -> None:
        self.call.cancel()  # type: ignore[no-untyped-call]
        self._thread.join(timeout=5.0)

    def __enter__(self) -> TimedConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def enqueue_many(
    svc: service_pb2_grpc.FilaServiceStub,
    queue_name: str,
    count: int,
    *,
    headers: dict[str, str] | None = None,
    window: int = 64,
) -> list[str]:
    """Enqueues `count` messages with up to `window` in flight (group commit friendly)."""
    ids: list[str] = []
    pending: list[Any] = []
    for i in range(count):
        request = service_pb2.EnqueueRequest(
            queue=queue_name, headers=headers or {}, payload=f"m{i}".encode()
        )
        pending.append(svc.Enqueue.future(request, timeout=30.0))
        if len(pending) >= window:
            ids.extend(f.result().message_id for f in pending)
            pending.clear()
    ids.extend(f.result().message_id for f in pending)
    return ids


def thread_sched(pid: int, tid: int | None = None) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of one thread.

    From /proc/<pid>/task/<tid>/schedstat; `tid` defaults to the main thread, which
    in `fila-server` runs the asyncio event loop (and so every Lua hook). CPU time
    measures how long the loop was busy independently of how loaded the host is;
    the wait time tells how much the host's CPU contention stretched wall time.
    """
    fields = Path(f"/proc/{pid}/task/{tid or pid}/schedstat").read_text().split()
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9
