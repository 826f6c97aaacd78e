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
