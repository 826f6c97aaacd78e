"""State every node shares through etcd (SPEC 9): runtime config, API keys and ACLs.

A single node keeps these in its own RocksDB. In a cluster they must hold on every
node, so etcd keeps them and each node mirrors them (`fila.cluster.mirror`):

- Runtime config: `SetConfig` writes to etcd and is answered once etcd has the value
  (and this node applied it). Every node applies each change to its own broker as
  it arrives, through the same path recovery uses, so `fila.get` in Lua and the
  throttle buckets follow; a bucket is kept by each queue's owner, so a throttle key
  used by queues on several nodes is enforced per node (documented).
- API keys and ACLs: the `Keyring` works as on a single node, with `EtcdKeyStore`
  as its store (the `KeyStore` interface exists for this). A change is written to
  etcd, applied in memory once etcd has it, and then answered; the other nodes apply
  it from their watch (`KeyMirror`). If the etcd write fails nothing changes here:
  the caller gets UNAVAILABLE and can retry, through this node or another. (A write
  that reached etcd though its answer did not comes back through the watch: what
  etcd holds stays the truth.)

A presented key this node has not seen yet (created through another node a moment
ago) is looked up by its digest (`find_key`) before the call is refused, so a key
works on every node as soon as its creation was answered.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from fila.cluster.etcd import Etcd
from fila.cluster.layout import Layout
from fila.cluster.mirror import Mirror
from fila.core.broker import Broker
from fila.core.errors import InvalidArgument
from fila.core.runtime_config import validate_entry
from fila.security import apikeys
from fila.security.acl import Permission
from fila.security.apikeys import ApiKeyRecord
from fila.security.keyring import Keyring
from fila.security.keystore import StoredKeys, decode_acl, encode_acl

log = logging.getLogger("fila.cluster")


class Section:
    """A mirror section made of two callables."""

    def __init__(self, put: Callable[[str, bytes], None], delete: Callable[[str], None]) -> None:
        self.put = put
        self.delete = delete


# -- runtime config -----------------------------------------------------------------------


class SharedConfig:
    def __init__(self, etcd: Etcd, layout: Layout, mirror: Mirror, broker: Broker) -> None:
        self._etcd = etcd
        self._layout = layout
        self._mirror = mirror
        self._broker = broker

    def section(self) -> Section:
        """Mirrors `<prefix>/config/` into this node's broker."""
        return Section(self._apply, lambda key: self._broker.apply_config(key, ""))

    def _apply(self, key: str, value: bytes) -> None:
        self._broker.apply_config(key, value.decode(errors="replace"))

    def forget_local(self) -> None:
        """Drops config recovered from this node's own storage: in a cluster, etcd's
        config is the config (what was stored locally is logged and ignored)."""
        local = self._broker.config.items()
        if local:
            log.warning(
                "ignoring %d runtime config entries in this node's storage: in cluster mode "
                "runtime config lives in etcd",
                len(local),
            )
        for key, _value in local:
            self._broker.apply_config(key, "")

    async def set(self, key: str, value: str) -> None:
        """SetConfig: checked as on a single node, written to etcd, applied here."""
        validate_entry(key, value)
        etcd_key = self._layout.config(key)
        if value == "":
            revision = await self._etcd.delete(etcd_key)
            self._mirror.apply(etcd_key, None, revision)
        else:
            revision = await self._etcd.put(etcd_key, value.encode())
            self._mirror.apply(etcd_key, value.encode(), revision)


# -- API keys and ACLs --------------------------------------------------------------------


class KeyMirror:
    """Mirrors `<prefix>/apikeys/` and `<prefix>/acls/` into the keyring. An ACL can
    arrive before its key (a snapshot lists `acls/` first), so ACLs are kept here too."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._acls: dict[str, tuple[Permission, ...]] = {}

    def keys_section(self) -> Section:
        return Section(self._put_key, self._keyring.mirror_remove)

    def acls_section(self) -> Section:
        return Section(self._put_acl, self._delete_acl)

    def _put_key(self, key_id: str, value: bytes) -> None:
        try:
            record = ApiKeyRecord.decode(key_id, value)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            # Fail closed: a key that cannot be read cannot authenticate.
            log.error("unreadable API key record in etcd ignored key_id=%s error=%s", key_id, exc)
            return
        self._keyring.mirror_key(record, self._acls.get(key_id, ()))

    def _put_acl(self, key_id: str, value: bytes) -> None:
        try:
            permissions = decode_acl(value)
        except (ValueError, TypeError, InvalidArgument, json.JSONDecodeError) as exc:
            log.error("unreadable ACL in etcd: no permissions key_id=%s error=%s", key_id, exc)
            permissions = ()
        self._acls[key_id] = permissions
        self._keyring.mirror_acl(key_id, permissions)

    def _delete_acl(self, key_id: str) -> None:
        self._acls.pop(key_id, None)
        self._keyring.mirror_acl(key_id, ())


class EtcdKeyStore:
    """`fila.security.keystore.KeyStore` in etcd (see the module docstring)."""

    def __init__(self, etcd: Etcd, layout: Layout, mirror: Mirror) -> None:
        self._etcd = etcd
        self._layout = layout
        self._mirror = mirror

    def load(self) -> StoredKeys:
        return StoredKeys([], {})  # keys arrive through the mirror

    def save_key(self, record: ApiKeyRecord) -> Awaitable[None]:
        return self._save_key(record)

    def save_acl(self, key_id: str, permissions: tuple[Permission, ...]) -> Awaitable[None]:
        return self._save_acl(key_id, permissions)

    def delete_key(self, key_id: str) -> Awaitable[None]:
        return self._delete_key(key_id)

    async def _save_key(self, record: ApiKeyRecord) -> None:
        key = self._layout.api_key(record.key_id)
        value = record.encode()
        revision = await self._etcd.put_many(
            {key: value, self._layout.digest(record.digest): record.key_id.encode()}
        )
        self._mirror.apply(key, value, revision)

    async def _save_acl(self, key_id: str, permissions: tuple[Permission, ...]) -> None:
        key = self._layout.acl(key_id)
        if permissions:
            value = encode_acl(permissions)
            revision = await self._etcd.put(key, value)
            self._mirror.apply(key, value, revision)
        else:
            revision = await self._etcd.delete(key)
            self._mirror.apply(key, None, revision)

    async def _delete_key(self, key_id: str) -> None:
        key = self._layout.api_key(key_id)
        entry, _ = await self._etcd.get(key)
        doomed = [key, self._layout.acl(key_id)]
        # (an unreadable record has no usable digest entry to delete)
        if entry is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError, json.JSONDecodeError):
                record = ApiKeyRecord.decode(key_id, entry.value)
                doomed.append(self._layout.digest(record.digest))
        revision = await self._etcd.delete(*doomed)
        for gone in doomed[:2]:
            self._mirror.apply(gone, None, revision)


async def find_key(etcd: Etcd, layout: Layout, mirror: Mirror, presented: str) -> None:
    """Brings a presented key's record and ACL here if etcd has them (see the module
    docstring): one read of its digest entry, and of the two records if found."""
    entry, _ = await etcd.get(layout.digest(apikeys.digest(presented)))
    if entry is None:
        return
    key_id = entry.value.decode(errors="replace")
    await mirror.refresh(layout.acl(key_id))
    await mirror.refresh(layout.api_key(key_id))
