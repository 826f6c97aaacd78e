"""Python client for the Fila broker.

`Client` blocks, `AsyncClient` runs on asyncio; both speak the `fila.v1` gRPC
API, return the plain records in `fila_sdk.types` and raise the classes in
`fila_sdk.errors`. `Worker` runs a handler per message of a queue and settles it.
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
