"""Counting the load generator's TCP connections to a broker, from /proc/net/tcp.

The harness claims "N connections", and for most clients that is simply true, but
gRPC pools subchannels per process: N `AsyncClient`s can share one TCP connection.
Counting what the kernel sees turns that claim into a measurement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

_ESTABLISHED: Final = "01"


def established_to(port: int, tables: tuple[str, ...] = ("tcp", "tcp6")) -> int:
    """Established TCP connections whose remote end is `port` on this host."""
    total = 0
    for table in tables:
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        total += count_established(lines, port)
    return total


def count_established(lines: list[str], port: int) -> int:
    """Rows of a /proc/net/tcp table (header removed) connected to remote `port`."""
    wanted = f"{port:04X}"
    count = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        remote, state = fields[2], fields[3]
        if state == _ESTABLISHED and remote.rsplit(":", 1)[-1] == wanted:
            count += 1
    return count
