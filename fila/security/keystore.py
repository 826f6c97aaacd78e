"""Where API keys and ACLs are kept: `KeyStore`, and `LocalKeyStore` in the broker's storage.

The `Keyring` holds the live state in memory and only tells a `KeyStore` what to
persist; the store answers with an awaitable that resolves once the change is
durable, so an RPC is answered only after its write is committed, like every
other state change. Cluster mode (SPEC 9) keeps keys and ACLs in etcd so that
they hold on every node: that is another implementation of this interface.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from fila.core.errors import InvalidArgument
from fila.security.acl import Permission, parse_permissions
from fila.security.apikeys import ApiKeyRecord
from fila.storage import keys
from fila.storage.backend import Storage
from fila.storage.committer import Committer

log = logging.getLogger("fila.security")


@dataclass(frozen=True, slots=True)
class StoredKeys:
    records: list[ApiKeyRecord]
    acls: dict[str, tuple[Permission, ...]]


class KeyStore(Protocol):
    def load(self) -> StoredKeys:
        """Everything stored, read once at startup."""
        ...

    def save_key(self, record: ApiKeyRecord) -> Awaitable[None]: ...

    def save_acl(self, key_id: str, permissions: tuple[Permission, ...]) -> Awaitable[None]: ...

    def delete_key(self, key_id: str) -> Awaitable[None]:
        """Deletes the key and its ACL together."""
        ...


class LocalKeyStore:
    """Keys under `k<key id>`, ACLs under `a<key id>` (see `fila.storage.keys`) in the
    broker's own storage, written through its group committer."""

    def __init__(self, storage: Storage, committer: Committer) -> None:
        self._storage = storage
        self._committer = committer

    def load(self) -> StoredKeys:
        """Raises CorruptionError if the records cannot all be read (startup stops)."""
        records = []
        for key, value in self._storage.scan(keys.API_KEY):
            key_id = keys.key_id_from_key(key)
            try:
                records.append(ApiKeyRecord.decode(key_id, value))
            except (ValueError, KeyError, TypeError) as exc:
                # Fail closed: a key that cannot be read cannot authenticate.
                log.error(
                    "unreadable API key record ignored", extra={"key_id": key_id, "error": str(exc)}
                )
        acls = {}
        for key, value in self._storage.scan(keys.ACL):
            key_id = keys.key_id_from_key(key)
            try:
                acls[key_id] = decode_acl(value)
            except (ValueError, TypeError, InvalidArgument) as exc:
                # Fail closed: the key keeps no permissions rather than guessed ones.
                log.error(
                    "unreadable ACL record ignored", extra={"key_id": key_id, "error": str(exc)}
                )
        return StoredKeys(records, acls)

    def save_key(self, record: ApiKeyRecord) -> Awaitable[None]:
        self._committer.put(keys.api_key_key(record.key_id), record.encode())
        return self._committer.flushed()

    def save_acl(self, key_id: str, permissions: tuple[Permission, ...]) -> Awaitable[None]:
        if permissions:
            self._committer.put(keys.acl_key(key_id), encode_acl(permissions))
        else:
            self._committer.delete(keys.acl_key(key_id))
        return self._committer.flushed()

    def delete_key(self, key_id: str) -> Awaitable[None]:
        self._committer.delete(keys.api_key_key(key_id))
        self._committer.delete(keys.acl_key(key_id))
        return self._committer.flushed()


def encode_acl(permissions: tuple[Permission, ...]) -> bytes:
    """The stored form of an ACL (here and in etcd, see `fila.cluster.shared`)."""
    return json.dumps([[p.kind.value, p.pattern.text] for p in permissions]).encode()


def decode_acl(raw: bytes) -> tuple[Permission, ...]:
    doc = json.loads(raw)
    if not isinstance(doc, list):
        raise ValueError("ACL record is not a list")
    return parse_permissions((str(kind), str(pattern)) for kind, pattern in doc)
