"""Operating-system limits the broker sets for itself at startup.

Every client connection costs a file descriptor, and so does every RocksDB file
and WAL. With the default soft limit of 1,024 (256 on some systems), a few
hundred idle connections were enough to make RocksDB's next WAL file fail with
"Too many open files", which stops the broker. So the soft limit is raised to
the hard limit, descriptors are reserved for storage, and the connection cap is
lowered to what remains (with a warning) rather than let clients starve storage.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("fila.server")

# RocksDB's max_open_files (see fila.storage.backend) plus WALs, the fsync thread,
# the listening socket, logs and slack.
STORAGE_RESERVE_FDS = 512 + 128


def raise_open_files_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_cap(configured: int, open_files: int) -> int:
    """`server.max_connections`, lowered so storage keeps its reserve of descriptors
    (half of them when the limit is small)."""
    reserve = min(STORAGE_RESERVE_FDS, open_files // 2)
    available = max(16, open_files - reserve)
    if configured > available:
        log.warning(
            "server.max_connections=%d lowered to %d: the open-files limit is %d and %d "
            "descriptors are kept for storage (raise the limit, e.g. LimitNOFILE= in systemd)",
            configured,
            available,
            open_files,
            reserve,
        )
        return available
    return configured


# Calls (HTTP/2 streams) one connection may have open at once, advertised to clients
# as SETTINGS_MAX_CONCURRENT_STREAMS. Without one (gRPC sets none), a peer
# that opens streams and resets them at once (HTTP/2 "rapid reset", CVE-2023-44487)
# started every call it opened, and every other client's call failed with CANCELLED
# meanwhile. With a limit, gRPC's overload protection also counts the streams a peer
# reset whose calls the broker has not finished yet, and refuses new ones beyond it
# (RST_STREAM REFUSED_STREAM) before they reach Python. An SDK client needs one
# stream per queue it consumes, one StreamEnqueue and its calls in flight; a gRPC
# client holds calls past the limit until a stream frees (they wait, they do not
# fail). The cost of the limit to the other clients grows with it: a connection
# resetting as fast as it can delays another client's calls, and grows the broker's
# memory, more at a higher limit, though none of those calls failed (figures:
# docs/benchmarks.md, "Measurements behind design choices"). A lower limit would
# leave a client with more long-lived streams waiting for good.
STREAMS_PER_CONNECTION = 1024


def streams_per_connection(max_connections: int, cluster: bool) -> int:
    """The per-connection stream limit: `STREAMS_PER_CONNECTION`, or in cluster mode
    at least `max_connections`. A node forwards the StreamEnqueue of each of its
    producers whose messages go to another node over its one connection to that node
    (`fila.cluster.streams`), so that connection holds up to one stream per client
    connection of the forwarding node; past the limit a producer's forwarded stream
    would wait for another one to end."""
    return max(STREAMS_PER_CONNECTION, max_connections) if cluster else STREAMS_PER_CONNECTION
