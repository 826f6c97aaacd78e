"""Whether two `advertise_addr`s name one socket address: the one place that decides.

The others forward a node's calls to the address in its record (`fila.cluster.peers`),
so two live nodes whose addresses reach one socket receive each other's calls; startup
refuses a node at a live node's address (`fila.cluster.lease`) and a running node logs
an error when one appears (`fila.cluster.node`). Compared as text, `localhost:5555`
and `127.0.0.1:5555` (or `[::1]:5555` and `[0:0::1]:5555`, `Fila-1:5555` and
`fila-1:5555`) passed as two addresses although a peer dialling either reaches the
same listener. So an address is reduced to its *endpoints*:

- its text, normalised: the host lower-cased (DNS names are case-insensitive), IPv6
  brackets and a trailing root dot dropped, an IP literal in its canonical form (an
  IPv4-mapped IPv6 address as its IPv4 address), the port an integer (`05555` is 5555);
- every numeric address its host resolves to (getaddrinfo, TCP), with the port.

Two addresses are one when their endpoints meet: a peer dialling one may land on the
socket the other names (gRPC tries a name's addresses in turn). The names are
resolved here, on this node; the peers resolve them on theirs, normally against the
same DNS, so this is the best view one node has of where the others' calls go.

Resolution never blocks the event loop: `loop.getaddrinfo` runs in the loop's
resolver thread, and the comparison waits at most `RESOLVE_TIMEOUT_S` for it. A name
that does not resolve (no such name, DNS down, too slow) is compared by its text
alone, with one warning, and does not stop startup. Refusing it (exit code 2) would
turn a DNS outage, or a record published only once the node serves (a Kubernetes
headless service's pods, by default), into a configuration error that the service
manager does not retry (`RestartPreventExitStatus=2`): this check guards against a
copied configuration and is not worth a node that cannot start while DNS is late.
A name that never resolves still shows, in the warning and in the peers' failed
forwards. Results are kept for `CACHE_S`: startup compares with every live node
twice a second while it waits.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Final

from fila.wire import is_port

log = logging.getLogger("fila.cluster")

RESOLVE_TIMEOUT_S: Final = 2.0
CACHE_S: Final = 10.0

# (host, port): the host an IP address in canonical form, or the normalised name.
Endpoint = tuple[str, int]


def normalise(addr: str) -> Endpoint:
    """`addr`'s host and port in the form compared (see the module docstring).
    Raises ValueError when `addr` is not host:port."""
    host, sep, port = addr.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.lower().removesuffix(".")
    if not sep or not host or not is_port(port):
        raise ValueError(f"not host:port: {addr!r}")
    return _canonical_ip(host) or host, int(port)


def _canonical_ip(host: str) -> str | None:
    """`host` in ipaddress's canonical form if it is an IP literal ("0:0::1" -> "::1"),
    else None. An IPv4-mapped IPv6 address is its IPv4 address: a dual-stack peer
    dialling `[::ffff:127.0.0.1]` reaches the listener at `127.0.0.1`."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


class Addresses:
    """Compares advertise addresses (see the module docstring); one per node, for its
    cache and so that an unresolvable name is warned about once."""

    def __init__(self, timeout_s: float = RESOLVE_TIMEOUT_S, cache_s: float = CACHE_S) -> None:
        self._timeout_s = timeout_s
        self._cache_s = cache_s
        self._cache: dict[str, tuple[float, frozenset[Endpoint]]] = {}
        self._warned: set[str] = set()

    async def same(self, a: str, b: str) -> bool:
        """Whether a peer dialling `a` may reach the socket `b` names (and so a node
        at `a` and a node at `b` would receive each other's forwarded calls)."""
        if a == b:
            return True
        mine, theirs = await asyncio.gather(self.endpoints(a), self.endpoints(b))
        return not mine.isdisjoint(theirs)

    async def endpoints(self, addr: str) -> frozenset[Endpoint]:
        """`addr`'s normalised text and what its host resolves to. Text that is not
        host:port (a record another version wrote, say) is only itself."""
        try:
            host, port = normalise(addr)
        except ValueError:
            return frozenset({(addr, -1)})
        if _canonical_ip(host) is not None:  # a literal: nothing to resolve
            return frozenset({(host, port)})
        loop = asyncio.get_running_loop()
        now = loop.time()
        cached = self._cache.get(addr)
        if cached is not None and cached[0] > now:
            return cached[1]
        found = {(host, port)}
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self._timeout_s
            )
        except (OSError, UnicodeError, TimeoutError) as exc:
            if addr not in self._warned:
                self._warned.add(addr)
                reason = "no answer in time" if isinstance(exc, TimeoutError) else exc
                log.warning(
                    "advertise address %s does not resolve here (%s): compared with the "
                    "other nodes' addresses as text only",
                    addr,
                    reason,
                )
        else:
            for info in infos:
                ip = str(info[4][0])
                found.add((_canonical_ip(ip) or ip, port))
        result = frozenset(found)
        self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[addr] = (now + self._cache_s, result)
        return result
