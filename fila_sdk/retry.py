"""Getting back to the broker after losing it: what is worth retrying, and when.

A broker restart ends every stream: `UNAVAILABLE "broker is shutting down"` on
SIGTERM, `UNAVAILABLE "Stream removed"` after a crash. Consumers (`consume`, batched
or not, and `Worker`) are long-lived, so they do not pass that on to the caller:
they wait (capped exponential backoff with jitter), wait for the channel to
connect again, resubscribe, and log each step on the `fila_sdk` logger. They give
up with `BrokerUnreachableError` once the broker has been unreachable for the
client's `reconnect_timeout`, so a consumer pointed at a dead broker fails
instead of hanging forever.

The jitter keeps a fleet of consumers that lost the same broker from reconnecting
in lockstep; the cap keeps the last retry close to the moment the broker is back.
How quickly the channel itself retries the TCP connection is set by the channel
options in `fila_sdk._channel`.

One-shot calls (enqueue, ack, admin) are not retried: whether a failed call took
effect is unknown, and a blind retry could enqueue twice. They raise at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Self

import grpc
import grpc.aio

from ._channel import Settings
from .errors import BrokerUnreachableError, ClientClosedError, FilaError

log = logging.getLogger("fila_sdk")

# Status codes after which a stream is worth opening again: the broker went away
# or restarted (UNAVAILABLE), a stopping broker cancelled a call it had not started
# serving (CANCELLED; the client's own cancellations never get here), or the call
# failed in a way gRPC reports as UNKNOWN. Everything else (a missing queue, a
# refused key, a broker without the RPC) would fail the same way again.
RETRYABLE_CODES: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
)


# The longest single wait for the channel to connect: how often a waiting consumer
# checks whether its client was closed or its reconnect_timeout ran out.
_SLICE_S: Final = 0.5


def retryable(error: FilaError) -> bool:
    return error.code in RETRYABLE_CODES and not isinstance(error, ClientClosedError)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before attempt `n` (0-based): half of `min(maximum, initial * 2**n)`
    fixed, the other half random ("equal jitter")."""

    initial: float = 0.05
    maximum: float = 2.0

    def delay(self, attempt: int) -> float:
        ceiling: float = min(self.maximum, self.initial * 2.0 ** min(attempt, 32))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


DEFAULT_BACKOFF: Final = Backoff()


class Reconnector:
    """One consumer's way back to the broker: its failure window and backoff.

    `failed` is called with each retryable error and returns how long to wait
    before trying again, or raises `BrokerUnreachableError` once the broker has been
    unreachable for `timeout` seconds (None: never give up). `reached` is called
    when the channel is connected again; it ends the failure window.
    """

    def __init__(
        self,
        what: str,
        target: str,
        timeout: float | None,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._what = what
        self._target = target
        self._timeout = timeout
        self._backoff = backoff
        self._clock = clock
        self._since: float | None = None  # when the broker was lost, while it is
        self._attempt = 0
        self._last: FilaError | None = None

    @classmethod
    def of(cls, what: str, settings: Settings) -> Self:
        """A consumer's, with the client's address and `reconnect_timeout`."""
        return cls(what, settings.target, settings.reconnect_timeout)

    @property
    def backing_off(self) -> bool:
        return self._attempt > 0

    def failed(self, error: FilaError) -> float:
        now = self._clock()
        if self._since is None:
            self._since = now
            log.warning(
                "%s lost the broker at %s (%s); reconnecting", self._what, self._target, error
            )
        self._last = error
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise self.unreachable()
        delay = self._backoff.delay(self._attempt)
        self._attempt += 1
        return delay if remaining is None else min(delay, remaining)

    def remaining(self) -> float | None:
        """Seconds left before giving up, None if never (or if nothing failed)."""
        if self._timeout is None or self._since is None:
            return None
        return self._since + self._timeout - self._clock()

    def reached(self) -> None:
        """The broker can be reached again: the failure window ends. The backoff is
        kept until `delivered`, so a broker that accepts connections but keeps ending
        streams (while it shuts down) is not retried in a tight loop."""
        if self._since is not None:
            log.info(
                "%s reconnected to %s after %.2fs; resubscribing",
                self._what,
                self._target,
                self._clock() - self._since,
            )
        self._since = None
        self._last = None

    def delivered(self) -> None:
        """The stream works again (it received a frame): backoff starts over."""
        self._attempt = 0

    def unreachable(self) -> BrokerUnreachableError:
        error = BrokerUnreachableError(
            f"{self._what}: broker at {self._target} unreachable for {self._timeout:g}s "
            f"(reconnect_timeout); last error: {self._last}",
            grpc.StatusCode.UNAVAILABLE,
        )
        log.error("%s", error)
        return error

    async def wait_async(self, error: FilaError, probe: AsyncProbe, *stops: asyncio.Event) -> bool:
        """Backs off after `error`, then waits until `probe` reaches the broker: True
        then, False as soon as one of `stops` is set (the client closed, the worker
        stopped); raises `BrokerUnreachableError` when `reconnect_timeout` runs out
        first."""
        if any(stop.is_set() for stop in stops):
            return False
        waiting = asyncio.ensure_future(self._wait_async(error, probe))
        tasks = [waiting, *(asyncio.ensure_future(stop.wait()) for stop in stops)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if any(stop.is_set() for stop in stops):
            return False
        waiting.result()  # raises BrokerUnreachableError when it gave up
        return True

    async def _wait_async(self, error: FilaError, probe: AsyncProbe) -> None:
        await asyncio.sleep(self.failed(error))
        while True:
            remaining = self.remaining()
            if remaining is not None and remaining <= 0:
                raise self.unreachable()
            if await probe(_SLICE_S if remaining is None else min(_SLICE_S, remaining)):
                break
        self.reached()

    def wait_sync(self, error: FilaError, probe: SyncProbe, closed: threading.Event) -> bool:
        """The blocking `wait_async`; returns False as soon as `closed` is set."""
        if closed.wait(self.failed(error)):
            return False
        while not closed.is_set():
            remaining = self.remaining()
            if remaining is not None and remaining <= 0:
                raise self.unreachable()
            if probe(_SLICE_S if remaining is None else min(_SLICE_S, remaining)):
                self.reached()
                return not closed.is_set()
        return False


# Is the broker reachable? Each waits up to the given seconds for a connection.
SyncProbe = Callable[[float], bool]
AsyncProbe = Callable[[float], Awaitable[bool]]

# The standard health service: every broker serves it without credentials, and a
# foreign server without it still answers (UNIMPLEMENTED), which is all a probe needs.
_HEALTH_CHECK: Final = "/grpc.health.v1.Health/Check"
_EMPTY_CHECK: Final = b""  # HealthCheckRequest(service="") encodes to nothing


def sync_probe(channel: grpc.Channel) -> SyncProbe:
    """A probe that waits for `channel` to connect (wait_for_ready) and asks the broker
    for its health; reachable means it answered at all. Unlike a channel-ready future,
    it runs no polling thread that a concurrent `close()` could trip up."""
    check = channel.unary_unary(_HEALTH_CHECK, None, None)  # bytes in, bytes out

    def probe(wait_s: float) -> bool:
        try:
            check(_EMPTY_CHECK, timeout=wait_s, wait_for_ready=True)
        except grpc.RpcError as err:
            return bool(err.code() != grpc.StatusCode.DEADLINE_EXCEEDED)
        return True

    return probe


def async_probe(channel: grpc.aio.Channel) -> AsyncProbe:
    """`sync_probe` for a `grpc.aio` channel."""
    check = channel.unary_unary(_HEALTH_CHECK, None, None)  # bytes in, bytes out

    async def probe(wait_s: float) -> bool:
        try:
            await check(_EMPTY_CHECK, timeout=wait_s, wait_for_ready=True)
        except grpc.RpcError as err:
            return bool(err.code() != grpc.StatusCode.DEADLINE_EXCEEDED)
        return True

    return probe
