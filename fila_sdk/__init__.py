"""Python client for the Fila broker.

`Client` blocks (and is safe to share between threads), `AsyncClient` runs on asyncio;
both have the same methods, speak the `fila.v1` gRPC API, return the plain records
defined here (`Message`, `QueueStats`, ...) and raise the `FilaError` classes defined
here, one per way a call can fail. `Worker` runs a handler for every message of a
queue and settles it: an `AsyncWorker` on an `AsyncClient`, a `ThreadWorker` on a
`Client` (see `fila_sdk.worker` for how it works).

    from fila_sdk import Client, Worker

    with Client("localhost:5555") as client:
        client.create_queue("orders", exist_ok=True)
        client.enqueue("orders", b"hello", headers={"tenant": "acme"})
        Worker(client, "orders", print).run()   # until Ctrl-C or SIGTERM

This reference is generated from the docstrings by `scripts/sdk_docs.py`.
"""

from fila.wire import UNLIMITED_ATTEMPTS

from .aio import AsyncClient
from .client import Client
from .errors import (
    ApiKeyNotFoundError,
    ArgumentError,
    BrokerUnreachableError,
    ClientClosedError,
    ConfigKeyNotFoundError,
    DeadlineExceededError,
    FilaError,
    InvalidArgumentError,
    MessageNotFoundError,
    PermissionDeniedError,
    QueueAlreadyExistsError,
    QueueNotFoundError,
    ResourceExhaustedError,
    RPCError,
    UnauthenticatedError,
    UnavailableError,
)
from .types import (
    Acl,
    AclPermission,
    ApiKeyInfo,
    ConfigEntry,
    ConfigListing,
    CreatedApiKey,
    EnqueueItem,
    FairnessKeyStats,
    Message,
    PeekedState,
    PeekPage,
    QueueConfig,
    QueueDetails,
    QueueInfo,
    QueueStats,
    ThrottleKeyStats,
)
from .worker import AsyncWorker, ThreadWorker, Worker, WorkerStats

__all__ = [
    "UNLIMITED_ATTEMPTS",
    "Acl",
    "AclPermission",
    "ApiKeyInfo",
    "ApiKeyNotFoundError",
    "ArgumentError",
    "AsyncClient",
    "AsyncWorker",
    "BrokerUnreachableError",
    "Client",
    "ClientClosedError",
    "ConfigEntry",
    "ConfigKeyNotFoundError",
    "ConfigListing",
    "CreatedApiKey",
    "DeadlineExceededError",
    "EnqueueItem",
    "FairnessKeyStats",
    "FilaError",
    "InvalidArgumentError",
    "Message",
    "MessageNotFoundError",
    "PeekPage",
    "PeekedState",
    "PermissionDeniedError",
    "QueueAlreadyExistsError",
    "QueueConfig",
    "QueueDetails",
    "QueueInfo",
    "QueueNotFoundError",
    "QueueStats",
    "RPCError",
    "ResourceExhaustedError",
    "ThreadWorker",
    "ThrottleKeyStats",
    "UnauthenticatedError",
    "UnavailableError",
    "Worker",
    "WorkerStats",
]
