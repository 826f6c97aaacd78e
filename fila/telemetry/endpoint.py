"""The Prometheus endpoint (`[telemetry] prometheus_listen`): bounded whatever clients do.

prometheus_client's `start_http_server` gave every connection a thread and no
deadline, and ran a full collection for each request. Against the broker, idle
connections each held a thread and a file descriptor, which the gRPC connection cap
budgets for; when half-sent requests were dropped by their client, each thread read
end-of-file as the end of the headers and ran a collection for nobody, and SIGTERM
waited behind them; concurrent scrapes ran their collections side by side. Later, as
many connections as there were slots, sending nothing and reopened as they were
dropped, held every slot while their heads were awaited, and every scrape was
answered 503 (figures: docs/benchmarks.md, "Measurements behind design choices").

Here, with the standard library's `http.server` parsing and answering:

- one thread (`_Acceptor`) accepts connections and reads their request heads without
  blocking, for all of them at once: a connection whose head is still arriving costs
  a descriptor and no thread, and holds no slot. At most `MAX_WAITING` wait so; a new
  connection beyond that drops the oldest waiting one, which has had the longest to
  send its request (a scraper sends its request as soon as it connects);
- a request's head must arrive complete, ending in its blank line, within
  `REQUEST_TIMEOUT_S` of the connection, and stay under `MAX_HEAD_BYTES`; a
  connection that is slow, too large, or closed before the blank line is dropped
  without a collection, as is a complete request whose client has already left;
- only a complete request takes one of `MAX_CONNECTIONS` slots and a thread to be
  answered; one that finds every slot taken is answered 503 by the accepting thread;
- a response must be written within `RESPONSE_TIMEOUT_S`; every connection is closed
  after one response (HTTP/1.0, as prometheus_client's server did);
- collections run one at a time (`SharedRenders`): requests that arrive while one is
  running for their format wait for it and are sent its result, so N scrapers cost
  one collection, not N;
- stopping closes the listening socket and the waiting connections, and waits for the
  accepting thread only; answering threads are daemons with their own deadlines, so
  shutdown does not wait for clients.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import logging
import selectors
import socket
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
MAX_CONNECTIONS = 16  # requests being answered at once, each on a thread
# Connections whose request head is still arriving (a descriptor each, no thread).
# With the answered ones and the listener, the endpoint holds at most 81 descriptors.
MAX_WAITING = 64
# The whole request head (request line and headers), from the connection's accept.
REQUEST_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 16 * 1024
# Writing the whole response: tens of MB at 10,000 queues uncompressed, far less gzipped.
RESPONSE_TIMEOUT_S = 30.0
# How long a request waits for the collection it shares (one runs at a time).
COLLECTION_WAIT_S = 60.0
# zlib's default: as small as level 9 on this text and much faster (prometheus_client
# used 9; figures: docs/benchmarks.md).
GZIP_LEVEL = 6
_POLL_S = 0.2  # how often the accepting thread looks for `stop`
# Connections accepted per turn of the accepting thread, between reads of the waiting
# heads: a flood of new connections cannot push out a request that has arrived.
_ACCEPTS_PER_TURN = 16
_BACKLOG = 64

_REFUSED = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 22\r\nConnection: close\r\n\r\ntoo many connections\r\n"
)


class Rendered:
    """One collection's body, in chunks, and its gzip, compressed once for all who
    share it. Chunks are sent (and compressed, which releases the GIL) one at a time:
    no step copies the whole body in one call that holds the GIL."""

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


class _Waiting:
    """A connection whose request head is still arriving."""

    __slots__ = ("address", "deadline", "head", "sock")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.head = bytearray()
        self.deadline = deadline


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers one request whose head has arrived whole (read by `_Acceptor`)."""

    protocol_version = "HTTP/1.0"

    def __init__(
        self, sock: socket.socket, address: Any, head: bytes, renders: SharedRenders
    ) -> None:
        # `BaseRequestHandler.__init__` less its server, which nothing here uses.
        self.request, self.client_address = sock, address
        self._head, self.renders = head, renders
        self.setup()
        try:
            self.handle()
        finally:
            self.finish()

    def setup(self) -> None:
        self.request.settimeout(RESPONSE_TIMEOUT_S)
        super().setup()

    def handle(self) -> None:
        self.rfile.close()  # the socket's reader: unused, and it keeps the socket open
        self.rfile = io.BytesIO(self._head)  # the standard parser reads the complete head
        self.handle_one_request()

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
            rendered = self.renders.get(fmt)
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
        stops reading is dropped: `_Acceptor._answer` logs the `TimeoutError`)."""
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


class _Acceptor:
    """The listening socket, the connections whose heads are arriving, and the slots
    of the requests being answered.

    Its `serve` loop, on one thread, reads every waiting connection's head without
    blocking and accepts new connections; a complete head is handed to a thread of
    its own (`_answer`) if a slot is free, and answered 503 otherwise. Only `serve`
    touches `_waiting`; `_slots` and the counts are shared with the answering threads.
    """

    def __init__(self, listener: socket.socket, renders: SharedRenders) -> None:
        self._listener = listener
        self._renders = renders
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest first
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._count_lock = threading.Lock()
        self.answering = 0  # requests holding a slot
        self.finished = 0  # connections closed, however they ended
        self.stopping = threading.Event()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def serve(self) -> None:
        """Runs until `stopping` is set, then closes the listener and every waiting
        connection."""
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                wait = _POLL_S
                if self._waiting:
                    oldest = next(iter(self._waiting.values()))
                    wait = min(wait, max(0.0, oldest.deadline - now))
                ready: list[_Waiting | None] = [k.data for k, _ in self._selector.select(wait)]
                for waiting in ready:  # heads first: see `_ACCEPTS_PER_TURN`
                    if waiting is not None:
                        self._read(waiting)
                if None in ready:  # the listener
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for sock in list(self._waiting):
                self._drop(sock)
            self._selector.close()
            self._listener.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # e.g. out of descriptors: serve those it has, then retry
                log.debug("metrics accept failed", exc_info=True)
                self.stopping.wait(_POLL_S)  # rather than spin on a listener still ready
                return
            if len(self._waiting) >= MAX_WAITING:
                self._drop(next(iter(self._waiting)))
            sock.setblocking(False)
            waiting = _Waiting(sock, address, time.monotonic() + REQUEST_TIMEOUT_S)
            self._waiting[sock] = waiting
            self._selector.register(sock, selectors.EVENT_READ, waiting)

    def _read(self, waiting: _Waiting) -> None:
        try:
            chunk = waiting.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:  # reset
            chunk = b""
        if not chunk:  # closed before the blank line: a request that never completed
            self._drop(waiting.sock)
            return
        waiting.head += chunk
        end = _head_end(waiting.head)
        if end:
            self._dispatch(waiting, bytes(waiting.head[:end]))
        elif len(waiting.head) > MAX_HEAD_BYTES:
            self._drop(waiting.sock)

    def _expire(self, now: float) -> None:
        """Drops the connections whose head did not arrive in time (oldest first: they
        were accepted in deadline order)."""
        while self._waiting:
            sock, oldest = next(iter(self._waiting.items()))
            if oldest.deadline > now:
                return
            self._drop(sock)

    def _forget(self, sock: socket.socket) -> None:
        del self._waiting[sock]
        self._selector.unregister(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._forget(sock)
        self._close(sock, answered=False)

    def _dispatch(self, waiting: _Waiting, head: bytes) -> None:
        self._forget(waiting.sock)
        if not self._slots.acquire(blocking=False):
            _refuse(waiting.sock)
            self._close(waiting.sock, answered=True)
            return
        with self._count_lock:
            self.answering += 1
        try:
            threading.Thread(
                target=self._answer,
                args=(waiting.sock, waiting.address, head),
                name="fila-prometheus-request",
                daemon=True,  # a request never holds the process up
            ).start()
        except BaseException:  # no thread started: it cannot give the slot back
            self._release()
            self._close(waiting.sock, answered=False)
            raise

    def _answer(self, sock: socket.socket, address: Any, head: bytes) -> None:
        """On the request's own thread. The slot is given back before the socket is
        closed: a client that sees its connection end can count on the slot being
        free."""
        try:
            _Handler(sock, address, head, self._renders)
        except Exception:  # a client that resets or stops reading mid-response
            log.debug("metrics connection ended with an error", exc_info=True)
        finally:
            self._release()
            self._close(sock, answered=True)

    def _release(self) -> None:
        with self._count_lock:
            self.answering -= 1
        self._slots.release()

    def _close(self, sock: socket.socket, *, answered: bool) -> None:
        """Closes a connection, after an answer with end-of-file after what was sent
        (as `socketserver` did), and counts it in `finished`."""
        if answered:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        sock.close()
        with self._count_lock:
            self.finished += 1


def _refuse(request: socket.socket) -> None:
    """Best effort 503 without blocking the accepting thread."""
    try:
        request.setblocking(False)
        request.send(_REFUSED)
    except OSError:
        pass


class MetricsEndpoint:
    """The listening endpoint and its accepting thread."""

    def __init__(self, host: str, port: int, render: Callable[[Format], list[bytes]]) -> None:
        """Binds and starts serving; raises `OSError` if the address cannot be used."""
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:  # as `http.server.HTTPServer` bound (dual-stack as the system sets it)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((str(sockaddr[0]), int(sockaddr[1])))
            listener.listen(_BACKLOG)
        except OSError:
            listener.close()
            raise
        self.renders = SharedRenders(render)
        self._port = int(listener.getsockname()[1])
        self._acceptor = _Acceptor(listener, self.renders)
        self._thread = threading.Thread(
            target=self._acceptor.serve, name="fila-prometheus", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._port

    @property
    def connections(self) -> int:
        """Requests being answered now (each holds one of `MAX_CONNECTIONS` slots)."""
        return self._acceptor.answering

    @property
    def waiting(self) -> int:
        """Connections whose request head is still arriving (at most `MAX_WAITING`)."""
        return self._acceptor.waiting

    @property
    def finished(self) -> int:
        """Connections closed so far: answered, refused or dropped."""
        return self._acceptor.finished

    def stop(self, timeout: float) -> None:
        """Stops accepting and closes the listening socket within `timeout` seconds
        (the accepting thread notices within `_POLL_S`).

        In-flight requests finish (or fail) on their own daemon threads, within their
        own deadlines: shutdown does not wait for clients."""
        self._acceptor.stopping.set()
        self._thread.join(timeout)
