"""Reads of shared state (runtime config, API keys, ACLs) refreshed from etcd first.

Every node keeps a mirror of etcd's shared sections (`fila.cluster.mirror`), kept
current by a watch. A read an operator makes right after a write on another node
must see that write, so a read of shared state first refreshes the keys it reads
from etcd (one linearizable range), then is answered from the mirror by the ordinary
handler. With etcd away it is answered from the mirror as it is, and logged.
"""

from __future__ import annotations

from typing import TypeAlias

from fila.cluster.layout import ACLS, API_KEYS, Layout
from fila.cluster.mirror import Mirror
from fila.cluster.routing import Reads
from fila.server import access
from fila.v1 import admin_pb2

# The requests whose rule is Route.FRESH (fila.cluster.routing.ROUTES).
FreshRequest: TypeAlias = (
    admin_pb2.GetConfigRequest
    | admin_pb2.ListConfigRequest
    | admin_pb2.RevokeApiKeyRequest
    | admin_pb2.SetAclRequest
    | admin_pb2.GetAclRequest
    | admin_pb2.ListApiKeysRequest
)

_MAX_CONFIG_KEY = 1024
_MAX_KEY_ID = 255


class FreshReads:
    def __init__(self, layout: Layout, mirror: Mirror) -> None:
        self._layout = layout
        self._mirror = mirror

    async def refresh(self, reads: Reads, request: FreshRequest) -> None:
        """Refreshes from etcd what answering `request` reads. Raises EtcdUnavailable."""
        layout, mirror = self._layout, self._mirror
        if reads is Reads.CONFIG_KEY:
            assert isinstance(request, admin_pb2.GetConfigRequest)
            if 0 < len(request.key) <= _MAX_CONFIG_KEY:
                await mirror.refresh(layout.config(request.key))
        elif reads is Reads.CONFIG:
            assert isinstance(request, admin_pb2.ListConfigRequest)
            if len(request.prefix) <= _MAX_CONFIG_KEY:
                await mirror.refresh_prefix(layout.config(request.prefix))
        elif reads is Reads.KEY_ID:
            assert isinstance(
                request,
                admin_pb2.RevokeApiKeyRequest | admin_pb2.SetAclRequest | admin_pb2.GetAclRequest,
            )
            # Read only for a caller the Keyring might answer (whoever may not manage
            # keys is refused from this node's copy, without making etcd read).
            if 0 < len(request.key_id) <= _MAX_KEY_ID and access.may_manage_keys(request.key_id):
                await mirror.refresh(layout.acl(request.key_id))
                await mirror.refresh(layout.api_key(request.key_id))
        elif access.may_manage_keys():
            await mirror.refresh_prefix(layout.section(ACLS))
            await mirror.refresh_prefix(layout.section(API_KEYS))
