"""The Prometheus endpoint (`[telemetry] prometheus_listen`): bounded whatever clients do.

prometheus_client's `start_http_server` gave every connection a thread and no
deadline, and ran a full collection for each request. Measured against the broker:
6,200 idle connections made 6,200 threads (RSS 75 -> 230 MB) and held as many file
descriptors, which the gRPC connection cap budgets for; when 2,000 half-sent requests
were dropped by their client, each thread read end-of-file as the end of the headers
and ran a collection for nobody, and SIGTERM took 15 to 40 s behind them. Eight
concurrent scrapes of 5,000 queues ran eight collections side by side (RSS 536 MB).

Here, on the standard library's `socketserver`/`http.server`:

- at most `MAX_CONNECTIONS` connections are served at once; the accepting thread
  answers any beyond that with a 503 and closes it, without a thread;
- a request's head must arrive complete, ending in its blank line, within
  `REQUEST_TIMEOUT_S` of the connection, and stay under `MAX_HEAD_BYTES`; a
  connection that is slow, too large, or closed before the blank line is dropped
  without a collection, as is a complete request whose client has already left;
- a response must be written within `RESPONSE_TIMEOUT_S`; every connection is closed
  after one response (HTTP/1.0, as prometheus_client's server did);
- collections run one at a time (`SharedRenders`): requests that arrive while one is
  running for their format wait for it and are sent its result, so N scrapers cost
  one collection, not N;
- stopping closes the listening socket and waits for the accept loop only; handler
  threads are daemons with their own deadlines, so shutdown does not wait for clients.
"""

from __future__ import annotations

import http.server
import io
import logging
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prometheus_client.exposition import gzip_accepted

from fila.telemetry.prometheus import Format, negotiate

log = logging.getLogger("fila.telemetry")

# Scrapers are few (a Prometheus pair, an agent, a person with curl) and each
# connection carries one request, so a slot is free again within a scrape's time.
MAX_CONNECTIONS = 16
# The whole request head (request line and headers), from the connection's accept.
REQUEST_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 16 * 1024
# Writing the whole response: 20 MB at 10,000 queues uncompressed, about 1 MB gzipped.
RESPONSE_TIMEOUT_S = 30.0
# How long a request waits for the collection it shares (one runs at a time).
COLLECTION_WAIT_S = 60.0
# zlib's default: as small as level 9 on this text, eight times faster (0.1 s vs 0.8 s
# for 17 MB; prometheus_client used 9).
GZIP_LEVEL = 6
_POLL_S = 0.2  # how often the accept loop looks for `stop`

_REFUSED = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 22\r\nConnection: close\r\n\r\ntoo many connections\r\n"
)


class Rendered:
    """One collection's body, in chunks, and its gzip, compressed once for all who
    share it. Chunks are sent (and compressed, which releases the GIL) one at a time:
    no step copies the whole 20 MB body in one call that holds the GIL."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self._gzipped: list[bytes] | None = None
        self._lock = threading.Lock()

    def gzipped(self) -> list[bytes]:
        with self._lock:
            if self._gzipped is None:
                gz = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # gzip
                compressed = [gz.compress(chunk) for chunk in self.chunks]
                compressed.append(gz.flush())
                self._gzipped = [chunk for chunk in compressed if chunk]
            return self._gzipped


class SharedRenders:
    """One collection at a time; requests arriving while one runs share its result.

    A collection reads every queue and holds the GIL for most of its run, so
    concurrent ones only slow each other and the event loop, and multiply the
    memory. The first request for a format starts one; requests for that format that
    arrive before it finishes wait for it and get its body. A request arriving after
    it finished starts the next: what a scrape is sent was read at most one
    collection's duration before it asked, and a scrape that follows a change sees
    it. Formats differ in their bytes, so each has its own in-flight collection, and
    they run one after another.
    """

    def __init__(self, render: Callable[[Format], list[bytes]]) -> None:
        self._render = render
        self._one_at_a_time = threading.Lock()
        self._lock = threading.Lock()
        self._running: dict[str, Future[Rendered]] = {}
        self.collections = 0  # how many ran
        self.waiting = 0  # requests waiting for one that is under way

    def get(self, fmt: Format, timeout: float = COLLECTION_WAIT_S) -> Rendered:
        """The body for `fmt`; raises `TimeoutError` after `timeout` seconds."""
        key = fmt.content_type
        with self._lock:
            running = self._running.get(key)
            if running is None:
                future = self._running[key] = Future()
            else:
                self.waiting += 1
        if running is not None:  # one is under way: its result is fresh enough
            try:
                return running.result(timeout)
            finally:
                with self._lock:
                    self.waiting -= 1
        try:
            if not self._one_at_a_time.acquire(timeout=timeout):
                raise TimeoutError("another collection is still running")
            try:
                self.collections += 1
                future.set_result(Rendered(self._render(fmt)))
            finally:
                self._one_at_a_time.release()
        except Exception as exc:
            future.set_exception(exc)
        finally:
            with self._lock:  # the next request starts a new collection
                del self._running[key]
        return future.result(0)


def _head_end(head: bytearray) -> int:
    """Where the request head ends (after its blank line), or 0 while incomplete."""
    for blank in (b"\r\n\r\n", b"\n\n"):
        at = head.find(blank)
        if at >= 0:
            return at + len(blank)
    return 0


class _Handler(http.server.BaseHTTPRequestHandler):
    """One request per connection, read whole and under a deadline before parsing."""

    server: _Server
    protocol_version = "HTTP/1.0"

    def handle(self) -> None:
        head = self._read_head()
        if head is None:
            return
        self.rfile.close()  # the socket's reader: unused, and it keeps the socket open
        self.rfile = io.BytesIO(head)  # the standard parser reads the complete head
        self.handle_one_request()

    def _read_head(self) -> bytes | None:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        head = bytearray()
        while not (end := _head_end(head)):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or len(head) > MAX_HEAD_BYTES:
                return None
            self.connection.settimeout(remaining)
            try:
                chunk = self.connection.recv(4096)
            except OSError:  # the deadline passed, or the connection was reset
                return None
            if not chunk:  # closed before the blank line: a request that never completed
                return None
            head += chunk
        return bytes(head[:end])

    def _client_left(self) -> bool:
        """True if the client closed its side after sending the request: nobody would
        read the answer, so no collection is started for it."""
        self.connection.settimeout(0)
        try:
            peeked: bytes = self.connection.recv(1, socket.MSG_PEEK)
            return not peeked
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            self.connection.settimeout(RESPONSE_TIMEOUT_S)

    def do_GET(self) -> None:
        self._metrics(send_body=True)

    def do_HEAD(self) -> None:
        self._metrics(send_body=False)

    def _metrics(self, *, send_body: bool) -> None:
        if self.path.split("?", 1)[0] == "/favicon.ico":  # as prometheus_client answered
            self._reply(200, "text/plain", [], send_body)
            return
        fmt = negotiate(self.headers.get("Accept"))
        if self._client_left():
            self.close_connection = True
            return
        try:
            rendered = self.server.renders.get(fmt)
        except TimeoutError:
            self._reply(503, "text/plain", [b"metrics collection timed out\r\n"], send_body)
            return
        except Exception:
            log.exception("metrics collection failed")
            self._reply(500, "text/plain", [b"metrics collection failed\r\n"], send_body)
            return
        if gzip_accepted(self.headers.get("Accept-Encoding", "")):
            self._reply(200, fmt.content_type, rendered.gzipped(), send_body, gzip=True)
        else:
            self._reply(200, fmt.content_type, rendered.chunks, send_body)

    def _reply(
        self,
        status: int,
        content_type: str,
        body: list[bytes],
        send_body: bool,
        *,
        gzip: bool = False,
    ) -> None:
        """Sends the response, all of it within `RESPONSE_TIMEOUT_S` (a client that
        stops reading is dropped; the stdlib's handler catches the `TimeoutError`)."""
        deadline = time.monotonic() + RESPONSE_TIMEOUT_S
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(sum(map(len, body))))
        if gzip:
            self.send_header("Content-Encoding", "gzip")
        self.connection.settimeout(RESPONSE_TIMEOUT_S)
        self.end_headers()
        for chunk in body if send_body else ():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the client did not take the response in time")
            self.connection.settimeout(remaining)
            self.wfile.write(chunk)

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (prometheus_client's server did not log them either)."""


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """HTTPServer with a thread per connection, up to `MAX_CONNECTIONS` of them."""

    daemon_threads = True  # a handler never holds the process up
    block_on_close = False  # nor does `server_close` wait for handlers
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        self.renders: SharedRenders  # set by `MetricsEndpoint`
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._count_lock = threading.Lock()
        self.connections = 0
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        """Binds without `HTTPServer`'s reverse DNS lookup of the address (`getfqdn`),
        which can stall startup for seconds and names nothing this server uses."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        with self._count_lock:
            self.connections += 1
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it cannot give the slot back
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """`ThreadingMixIn`'s, with the slot given back before the socket is closed: a
        client that sees its connection end can count on the slot being free (it
        was not, for a moment, and a scrape right after a full house was refused)."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._release()
            self.shutdown_request(request)

    def _release(self) -> None:
        with self._count_lock:
            self.connections -= 1
        self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets or stops reading mid-response is routine: one debug line,
        not the standard library's traceback on stderr."""
        log.debug("metrics connection ended with an error", exc_info=True)


def _refuse(request: socket.socket) -> None:
    """Best effort 503 without blocking the accepting thread."""
    try:
        request.setblocking(False)
        request.send(_REFUSED)
    except OSError:
        pass


class MetricsEndpoint:
    """The listening endpoint and its accept loop's thread."""

    def __init__(self, host: str, port: int, render: Callable[[Format], list[bytes]]) -> None:
        """Binds and starts serving; raises `OSError` if the address cannot be used."""
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.renders = SharedRenders(render)
        self._server = _Server((str(sockaddr[0]), int(sockaddr[1])), family)
        self._server.renders = self.renders
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="fila-prometheus",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def connections(self) -> int:
        """Connections being served now (each holds one of `MAX_CONNECTIONS` slots)."""
        return self._server.connections

    def stop(self, timeout: float) -> None:
        """Stops accepting and closes the listening socket within `timeout` seconds.

        In-flight requests finish (or fail) on their own daemon threads, within their
        own deadlines: shutdown does not wait for clients. `shutdown()` itself waits,
        without a limit, for the accept loop to notice; it is waited for here with one."""
        deadline = time.monotonic() + timeout
        stopper = threading.Thread(
            target=self._server.shutdown, name="fila-prometheus-stop", daemon=True
        )
        stopper.start()
        stopper.join(timeout)
        self._server.server_close()
        self._thread.join(max(0.0, deadline - time.monotonic()))
