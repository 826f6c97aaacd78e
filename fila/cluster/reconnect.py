"""How fast a node's gRPC channels (to its peers, to etcd) reconnect.

gRPC's default reconnect backoff grows to 120 s: after a long outage of a peer or of
etcd, a node would keep its channel idle for up to two minutes after the other side
came back, serving nothing meanwhile (a node without etcd cannot renew its lease).
Retrying every 100-500 ms costs a connection attempt per half second to a host that
is down, and brings a node back within half a second of the other side.
"""

from __future__ import annotations

from typing import Final

RECONNECT_BACKOFF: Final = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
