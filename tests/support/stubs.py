"""Raw `fila.v1` gRPC access for tests: stubs, error inspection and consume streams.

Deliberately built on the generated stubs only (no `fila_sdk`), so what these
helpers observe is exactly what goes over the wire.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from fila.v1 import admin_pb2, admin_pb2_grpc, messages_pb2, service_pb2, service_pb2_grpc
from fila.wire import ERROR_KIND_METADATA_KEY

# Generous per-call deadline for unary RPCs: a hung broker fails the test, not the run.
RPC_TIMEOUT_S = 10.0


@dataclass
class Fila:
    channel: grpc.Channel
    svc: service_pb2_grpc.FilaServiceStub
    admin: admin_pb2_grpc.FilaAdminStub

    # ------------------------------------------------------------- conveniences

    def create_queue(
        self,
        name: str,
        *,
        on_enqueue: str = "",
        on_failure: str = "",
        visibility_timeout_ms: int = 0,
        retry_backoff: str = "",
        max_attempts: int = 0,
    ) -> admin_pb2.CreateQueueResponse:
        config = admin_pb2.QueueConfig(
            on_enqueue_script=on_enqueue,
            on_failure_script=on_failure,
            visibility_timeout_ms=visibility_timeout_ms,
            retry_backoff=retry_backoff,
            max_attempts=max_attempts,
        )
        return self.admin.CreateQueue(
            admin_pb2.CreateQueueRequest(name=name, config=config), timeout=RPC_TIMEOUT_S
        )

    def enqueue(
        self, queue_name: str, payload: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> str:
        reply = self.svc.Enqueue(
            service_pb2.EnqueueRequest(queue=queue_name, headers=headers or {}, payload=payload),
            timeout=RPC_TIMEOUT_S,
        )
        return str(reply.message_id)

    def ack(self, queue_name: str, message_id: str) -> None:
        self.svc.Ack(
            service_pb2.AckRequest(queue=queue_name, message_id=message_id), timeout=RPC_TIMEOUT_S
        )

    def nack(self, queue_name: str, message_id: str, error: str = "") -> None:
        self.svc.Nack(
            service_pb2.NackRequest(queue=queue_name, message_id=message_id, error=error),
            timeout=RPC_TIMEOUT_S,
        )

    def stats(self, queue_name: str) -> admin_pb2.GetStatsResponse:
        return self.admin.GetStats(
            admin_pb2.GetStatsRequest(queue=queue_name), timeout=RPC_TIMEOUT_S
        )

    def list_queues(self) -> admin_pb2.ListQueuesResponse:
        return self.admin.ListQueues(admin_pb2.ListQueuesRequest(), timeout=RPC_TIMEOUT_S)

    def queue_names(self) -> list[str]:
        return sorted(q.name for q in self.list_queues().queues)

    def delete_queue(self, name: str) -> None:
        self.admin.DeleteQueue(admin_pb2.DeleteQueueRequest(queue=name), timeout=RPC_TIMEOUT_S)

    def consume(
        self, queue_name: str, *, read_limit: int | None = None, prefetch: int = 0
    ) -> ConsumeStream:
        return ConsumeStream(self.svc, queue_name, read_limit=read_limit, prefetch=prefetch)


@contextmanager
def connect(addr: str) -> Iterator[Fila]:
    with grpc.insecure_channel(addr) as channel:
        yield Fila(
            channel,
            service_pb2_grpc.FilaServiceStub(channel),
            admin_pb2_grpc.FilaAdminStub(channel),
        )


# ------------------------------------------------------------------------ errors


def rpc_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """Runs a unary call that must fail and returns its `RpcError` (a `grpc.Call`)."""
    kwargs.setdefault("timeout", RPC_TIMEOUT_S)
    try:
        reply = call(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"expected the call to fail, it returned {reply!r}")


def error_kind(err: grpc.RpcError) -> str | None:
    """The `x-fila-error-kind` trailing metadata value, or None if absent."""
    trailers: Any = err.trailing_metadata() or ()
    for key, value in trailers:
        if key == ERROR_KIND_METADATA_KEY:
            return str(value)
    return None


def status_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, details, error kind) of a failed call."""
    return err.code(), err.details() or "", error_kind(err)


# ------------------------------------------------------------------ consume streams

_END = object()


class StreamEnded(Exception):
    """The consume stream ended (with an error or cleanly) while a message was awaited."""

    def __init__(self, error: grpc.RpcError | None) -> None:
        self.error = error
        super().__init__(f"consume stream ended: {error!r}")


class ConsumeStream:
    """One `Consume` call read by a background thread, so reads can have deadlines.

    Keepalive frames (a `ConsumeResponse` without a message) are skipped, as the
    published clients do, and counted in `keepalives`. With `read_limit`, the
    thread stops reading from gRPC after that many messages: the stream stays
    open but the client no longer pulls, which is how a slow consumer looks.
    """

    def __init__(
        self,
        svc: service_pb2_grpc.FilaServiceStub,
        queue_name: str,
        *,
        read_limit: int | None = None,
        prefetch: int = 0,
    ) -> None:
        self.queue_name = queue_name
        self._svc = svc
        self.call = svc.Consume(service_pb2.ConsumeRequest(queue=queue_name, prefetch=prefetch))
        self.keepalives = 0
        self.frames: list[service_pb2.ConsumeResponse] = []
        self.error: grpc.RpcError | None = None
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._read_limit = read_limit
        self._received = 0
        self._stop_reading = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for frame in self.call:
                self.frames.append(frame)
                if not frame.HasField("message"):
                    self.keepalives += 1
                    continue
                self._inbox.put(frame.message)
                self._received += 1
                if self._read_limit is not None and self._received >= self._read_limit:
                    self._stop_reading.wait()  # hold the stream open without reading
                    return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        finally:
            self._inbox.put(_END)

    def get(self, timeout: float = 5.0) -> messages_pb2.Message:
        """The next delivered message; raises `TimeoutError` or `StreamEnded`."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message on {self.queue_name!r} within {timeout}s") from None
        if item is _END:
            self._inbox.put(_END)  # keep reporting the end to later calls
            raise StreamEnded(self.error)
        message: messages_pb2.Message = item
        return message

    def poll(self) -> list[messages_pb2.Message]:
        """Every message already received and not yet returned, without waiting."""
        out: list[messages_pb2.Message] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if item is _END:
                self._inbox.put(_END)
                return out
            out.append(item)

    @property
    def done(self) -> bool:
        """True once the reading thread has finished (stream ended or cancelled)."""
        return not self._thread.is_alive()

    def take(
        self, count: int, timeout: float = 10.0, *, ack: bool = False
    ) -> list[messages_pb2.Message]:
        """Exactly `count` messages, all within `timeout` seconds in total.

        With `ack`, each message is acked as soon as it arrives, as a real consumer
        would; a broker that bounds unacknowledged deliveries per consumer then keeps
        delivering.
        """
        deadline = time.monotonic() + timeout
        out: list[messages_pb2.Message] = []
        for _ in range(count):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"got {len(out)} of {count} messages within {timeout}s")
            message = self.get(remaining)
            out.append(message)
            if ack:
                self._svc.Ack(
                    service_pb2.AckRequest(queue=self.queue_name, message_id=message.id),
                    timeout=RPC_TIMEOUT_S,
                )
        return out

    def ended(self, timeout: float) -> StreamEnded:
        """Waits for the stream to end and returns how it ended; fails on a message."""
        try:
            message = self.get(timeout)
        except StreamEnded as end:
            return end
        raise AssertionError(f"expected the stream to end, got message {message.id}")

    def cancel(self) -> None:
        self.call.cancel()  # type: ignore[no-untyped-call]
        self._stop_reading.set()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> ConsumeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


# ------------------------------------------------------------- batch-path streams


class StreamConsumer:
    """One `StreamConsume` call: deliveries read by a thread, settlements sent on demand.

    `frames` keeps every non-keepalive frame as received (so a test can check frame
    shapes); `get()` returns messages one at a time with a deadline. `ack(ids)` and
    `nack(id, error)` write a settlement request on the same stream.
    """

    def __init__(
        self,
        svc: service_pb2_grpc.FilaServiceStub,
        queue_name: str,
        *,
        max_batch: int = 0,
        prefetch: int = 0,
        read: bool = True,
    ) -> None:
        self.queue_name = queue_name
        self._requests: queue.Queue[Any] = queue.Queue()
        self._requests.put(
            service_pb2.StreamConsumeRequest(
                queue=queue_name, max_batch=max_batch, prefetch=prefetch
            )
        )
        self.call = svc.StreamConsume(self._request_iter())
        self.frames: list[service_pb2.ConsumeResponse] = []
        self.error: grpc.RpcError | None = None
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._read_allowed = threading.Event()
        if read:
            self._read_allowed.set()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _request_iter(self) -> Iterator[service_pb2.StreamConsumeRequest]:
        while (item := self._requests.get()) is not _END:
            yield item

    def _read(self) -> None:
        try:
            for frame in self.call:
                self._read_allowed.wait()
                if not frame.messages and not frame.HasField("message"):
                    continue
                self.frames.append(frame)
                for message in frame.messages or [frame.message]:
                    self._inbox.put(message)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        finally:
            self._inbox.put(_END)

    def get(self, timeout: float = 5.0) -> messages_pb2.Message:
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message on {self.queue_name!r} within {timeout}s") from None
        if item is _END:
            self._inbox.put(_END)
            raise StreamEnded(self.error)
        message: messages_pb2.Message = item
        return message

    def take(self, count: int, timeout: float = 10.0) -> list[messages_pb2.Message]:
        deadline = time.monotonic() + timeout
        return [self.get(max(0.0, deadline - time.monotonic())) for _ in range(count)]

    def ack(self, ids: list[str]) -> None:
        self._requests.put(service_pb2.StreamConsumeRequest(ack_ids=ids))

    def nack(self, message_id: str, error: str = "") -> None:
        nack = service_pb2.NackRequest(message_id=message_id, error=error)
        self._requests.put(service_pb2.StreamConsumeRequest(nacks=[nack]))

    def allow_reading(self) -> None:
        self._read_allowed.set()

    def ended(self, timeout: float) -> StreamEnded:
        try:
            message = self.get(timeout)
        except StreamEnded as end:
            return end
        raise AssertionError(f"expected the stream to end, got message {message.id}")

    def close(self) -> None:
        """Half-closes the request side: the broker ends the stream."""
        self._requests.put(_END)

    def cancel(self) -> None:
        self.call.cancel()  # type: ignore[no-untyped-call]
        self._requests.put(_END)
        self._read_allowed.set()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> StreamConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
