"""Python client for the Fila broker.

`Client` blocks, `AsyncClient` runs on asyncio; both speak the `fila.v1` gRPC
API, return the plain records in `fila_sdk.types` and raise the classes in
`fila_sdk.errors`.
"""

from .aio import AsyncClient
from .client import Client
from .errors import (
    ApiKeyNotFoundError,
    ConfigKeyNotFoundError,
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
    FairnessKeyStats,
    Message,
    PeekPage,
    QueueInfo,
    QueueStats,
    ThrottleKeyStats,
)

__all__ = [
    "Acl",
    "AclPermission",
    "ApiKeyInfo",
    "ApiKeyNotFoundError",
    "AsyncClient",
    "Client",
    "ConfigEntry",
    "ConfigKeyNotFoundError",
    "ConfigListing",
    "CreatedApiKey",
    "FairnessKeyStats",
    "FilaError",
    "InvalidArgumentError",
    "Message",
    "MessageNotFoundError",
    "PeekPage",
    "PermissionDeniedError",
    "QueueAlreadyExistsError",
    "QueueInfo",
    "QueueNotFoundError",
    "QueueStats",
    "RPCError",
    "ResourceExhaustedError",
    "ThrottleKeyStats",
    "UnauthenticatedError",
    "UnavailableError",
]
