"""Helpers shared by the test modules (importable as `support`; tests/ is on sys.path)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fila.testing.server import ServerProcess

# The `server_factory` fixture: make(config_toml=, env=, persist_mode=, start=, timeout=).
ServerFactory = Callable[..., ServerProcess]

T = TypeVar("T")


def unique(prefix: str) -> str:
    """A name no other test (or earlier run against the same broker) has used."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_until(
    predicate: Callable[[], T], timeout: float, *, interval: float = 0.02, what: str = ""
) -> T:
    """Polls `predicate` until it returns a truthy value, and returns that value.

    Raises `TimeoutError` (naming `what` and the last value seen) once `timeout`
    seconds pass, so a condition that never holds fails the test instead of hanging
    it. The interval only paces the polling; it is never what the test relies on.
    """
    deadline = time.monotonic() + timeout
    last = predicate()
    while not last:
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(f"{name} not true within {timeout}s (last value: {last!r})")
        time.sleep(interval)
        last = predicate()
    return last


async def until(predicate: Callable[[], object], what: str, within: float) -> None:
    """`wait_until` for asyncio tests: awaits a predicate (plain, or returning an
    awaitable) without blocking the loop; fails the test after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


def settled(read: Callable[[], int], quiet_s: float = 0.6, within: float = 30.0) -> int:
    """`read()` once it has stopped changing for `quiet_s` seconds (a broker that has
    taken all it will take); raises `TimeoutError` if it still changes after `within`."""
    deadline = time.monotonic() + within
    last, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise TimeoutError(f"still changing after {within}s (last value {last})")
        time.sleep(0.05)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
    return last


def resident_bytes_of(pid: int) -> int:
    """The resident size of process `pid`, in bytes (from /proc)."""
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


__all__ = [
    "ServerFactory",
    "ServerProcess",
    "resident_bytes_of",
    "settled",
    "unique",
    "until",
    "wait_until",
]


# --- asyncio (grpc.aio) helpers -------------------------------------------------------
# Appended for tests/test_recovery.py; usable by any test that drives the broker from
# an event loop.


async def async_wait_until(
    predicate: Callable[[], Awaitable[T]],
    within: float,
    *,
    interval: float = 0.02,
    what: str = "",
) -> T:
    """`wait_until` for an async predicate (e.g. one that calls GetStats over grpc.aio)."""
    deadline = time.monotonic() + within
    last = await predicate()
    while not last:
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(f"{name} not true within {within}s (last value: {last!r})")
        await asyncio.sleep(interval)
        last = await predicate()
    return last


__all__ += ["async_wait_until"]
