"""What a handler is, and what it may do that ends a worker instead of nacking."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from ..types import Message

AsyncHandler = Callable[[Message], Awaitable[object]]
SyncHandler = Callable[[Message], object]


class Fatal(Exception):
    """Carries what must end the worker rather than nack a message (see
    `Engine.fail`), out of a handler's thread as well."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def error_text(exc: BaseException) -> str:
    """A failed handler's nack text: the exception's message, else its class name."""
    return str(exc) or type(exc).__name__


def is_async(handler: object) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    call = getattr(handler, "__call__", None)  # noqa: B004 (its kind, not callable())
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def wrong_kind(handler: object, result: object, *, blocking: bool) -> TypeError:
    """The error for a handler of the wrong kind, found from what it returned."""
    if blocking:
        return TypeError(
            f"handler {handler!r} returned {type(result).__name__}: a ThreadWorker (on a "
            "Client) needs a blocking handler; use AsyncClient for an async one"
        )
    return TypeError(
        f"handler {handler!r} returned {type(result).__name__}: an AsyncWorker (on an "
        "AsyncClient) needs an async handler; use Client for a blocking one"
    )
