"""A bare HTTP/2 client over a plain socket, for tests that misbehave on purpose.

gRPC's own client cannot be made to open a stream and reset it at once, to hold a
connection without ever acknowledging the broker's SETTINGS, or to ignore its PINGs:
those are what the transport-abuse tests need. The few frames involved are written
by hand (RFC 9113 section 4.1 framing, RFC 7541 literal header fields without
indexing), so the test suite needs no HTTP/2 library.

Everything the broker sends is parsed into `Frame`s with the time they arrived;
`pump` reads what is there, answers SETTINGS and PINGs when asked to, and notes a
GOAWAY and the end of the connection. It also keeps the broker's flow-control
windows, so that `send_message` can send gRPC requests as fast as the broker takes
them and no faster; with `receive_window=0` the client grants the broker no window of
its own, so the broker can send it no answer at all: a client that never reads.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
DEFAULT_WINDOW, DEFAULT_MAX_FRAME = 65_535, 16_384
FLAG_ACK = 0x1
FLAG_END_STREAM = 0x1
FLAG_END_HEADERS = 0x4
CANCEL = 0x8  # RST_STREAM error code
REFUSED_STREAM = 0x7
ENHANCE_YOUR_CALM = 0xB


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream_id & 0x7FFFFFFF)
        + payload
    )


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """An HPACK block of literal fields without indexing and without Huffman coding:
    no dynamic table on either side, so every block stands alone."""
    out = bytearray()
    for name, value in headers:
        raw_name, raw_value = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(raw_name), 7) + raw_name
        out += _hpack_int(len(raw_value), 7) + raw_value
    return bytes(out)


def grpc_request_headers(
    path: str, authority: str = "127.0.0.1", metadata: tuple[tuple[str, str], ...] = ()
) -> bytes:
    return header_block(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
    )


HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def open_and_reset(first_stream_id: int, count: int, path: str = HEALTH_CHECK) -> bytes:
    """`count` requests, each a HEADERS immediately followed by its RST_STREAM(CANCEL):
    the HTTP/2 "rapid reset" pattern (CVE-2023-44487)."""
    block = grpc_request_headers(path)
    out = bytearray()
    for n in range(count):
        sid = first_stream_id + 2 * n
        out += frame(HEADERS, FLAG_END_HEADERS, sid, block)
        out += frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL))
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Frame:
    at: float  # time.monotonic() when it was parsed
    kind: int
    flags: int
    stream_id: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class GoAway:
    at: float
    last_stream_id: int
    error_code: int
    debug: bytes


@dataclass
class RawH2Connection:
    """One client connection speaking just enough HTTP/2 to misbehave.

    `ack_settings` and `ack_pings` choose whether the broker's SETTINGS and PINGs
    are acknowledged (a conforming peer does both at once). `receive_window` is the
    SETTINGS_INITIAL_WINDOW_SIZE announced (None: the default); the client never
    sends a WINDOW_UPDATE, so each stream takes at most that many bytes of answers.
    """

    host: str
    port: int
    ack_settings: bool = True
    ack_pings: bool = True
    receive_window: int | None = None
    sock: socket.socket = field(init=False)
    frames: list[Frame] = field(default_factory=list)
    goaway: GoAway | None = None
    closed_at: float | None = None
    opened_at: float = 0.0
    _buffer: bytearray = field(default_factory=bytearray)
    # The broker's flow control: what this client may still send, on the connection
    # and per stream, and the largest frame it takes.
    _send_window: int = DEFAULT_WINDOW
    _stream_windows: dict[int, int] = field(default_factory=dict)
    _peer_initial_window: int = DEFAULT_WINDOW
    _peer_max_frame: int = DEFAULT_MAX_FRAME
    # gRPC messages received per stream, and the start of the next one. (DATA frames
    # are kept in `frames` without their payload: it is here.)
    _messages: dict[int, list[bytes]] = field(default_factory=dict)
    _partial: dict[int, bytearray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.opened_at = time.monotonic()

    def start(self) -> RawH2Connection:
        """Sends the connection preface and a SETTINGS frame (empty unless
        `receive_window` is set)."""
        settings = b""
        if self.receive_window is not None:
            settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, self.receive_window)
        self.send(PREFACE + frame(SETTINGS, 0, 0, settings))
        return self

    def open_call(
        self, stream_id: int, path: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Starts a call on `stream_id` (odd, increasing) whose requests follow."""
        self._stream_windows[stream_id] = self._peer_initial_window
        self.send(
            frame(
                HEADERS, FLAG_END_HEADERS, stream_id, grpc_request_headers(path, metadata=metadata)
            )
        )

    def send_message(self, stream_id: int, message: bytes, within: float) -> bool:
        """Sends one gRPC message on an open call as the broker's windows allow; False
        if the broker granted no room for `within` seconds at some point (it stopped
        reading the call), with part of the message possibly sent."""
        data = memoryview(b"\x00" + struct.pack(">I", len(message)) + message)
        while data:
            room = min(self._send_window, self._stream_windows[stream_id], self._peer_max_frame)
            if room <= 0:
                granted = self._send_window, self._stream_windows[stream_id]
                deadline = time.monotonic() + within
                while (self._send_window, self._stream_windows[stream_id]) == granted:
                    if self.closed_at is not None or time.monotonic() >= deadline:
                        return False
                    self.pump(0.05)
                continue
            chunk, data = data[:room], data[room:]
            self._send_window -= len(chunk)
            self._stream_windows[stream_id] -= len(chunk)
            if not self.send(frame(DATA, 0, stream_id, bytes(chunk))):
                return False
        return True

    def send(self, data: bytes) -> bool:
        """Sends `data`; False (and the connection noted closed) if the broker has
        already closed it."""
        try:
            self.sock.sendall(data)
        except OSError:
            self._note_closed()
            return False
        return True

    def pump(self, wait: float = 0.0) -> None:
        """Reads whatever has arrived (waiting up to `wait` seconds for the first
        bytes), parses it, and answers as configured."""
        deadline = time.monotonic() + wait
        while self.closed_at is None:
            remaining = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], remaining)
            if not ready:
                return
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self._note_closed()
                return
            self._buffer += data
            self._parse()
            deadline = time.monotonic()  # then drain what is already there

    def end_requests(self, stream_id: int) -> None:
        """Half-closes a call: no more requests (an empty DATA frame with END_STREAM)."""
        self.send(frame(DATA, FLAG_END_STREAM, stream_id))

    def grant(self, stream_id: int, size: int) -> None:
        """Lets the broker send `size` more bytes of answers on `stream_id` (a
        WINDOW_UPDATE for the stream and one for the connection)."""
        increment = struct.pack(">I", size)
        self.send(
            frame(WINDOW_UPDATE, 0, stream_id, increment) + frame(WINDOW_UPDATE, 0, 0, increment)
        )

    def answers(self, stream_id: int) -> list[bytes]:
        """The gRPC messages received on `stream_id` so far, in order."""
        return self._messages.get(stream_id, [])

    def ended(self, stream_id: int) -> bool:
        """Whether the broker ended the call (its trailers, or a reset)."""
        return any(
            f.stream_id == stream_id
            and (f.kind == RST_STREAM or (f.kind == HEADERS and f.flags & FLAG_END_STREAM))
            for f in self.frames
        )

    def count(self, kind: int, *, flags: int | None = None) -> int:
        return sum(
            1 for f in self.frames if f.kind == kind and (flags is None or f.flags & flags == flags)
        )

    def rst_codes(self) -> dict[int, int]:
        """RST_STREAM frames received, by error code."""
        codes: dict[int, int] = {}
        for f in self.frames:
            if f.kind == RST_STREAM:
                code = struct.unpack(">I", f.payload[:4])[0]
                codes[code] = codes.get(code, 0) + 1
        return codes

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawH2Connection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _note_closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()

    def _parse(self) -> None:
        buf = self._buffer
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                return
            kind, flags = buf[3], buf[4]
            sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload = bytes(buf[9 : 9 + length])
            del buf[: 9 + length]
            now = time.monotonic()
            if kind == DATA:
                self._received(sid, payload)
                payload = b""
            self.frames.append(Frame(now, kind, flags, sid, payload))
            if kind == SETTINGS and not flags & FLAG_ACK:
                self._peer_settings(payload)
                if self.ack_settings:
                    self.send(frame(SETTINGS, FLAG_ACK, 0))
            elif kind == PING and not flags & FLAG_ACK and self.ack_pings:
                self.send(frame(PING, FLAG_ACK, 0, payload))
            elif kind == WINDOW_UPDATE:
                increment = struct.unpack(">I", payload[:4])[0] & 0x7FFFFFFF
                if sid == 0:
                    self._send_window += increment
                elif sid in self._stream_windows:
                    self._stream_windows[sid] += increment
            elif kind == GOAWAY and self.goaway is None:
                last, code = struct.unpack(">II", payload[:8])
                self.goaway = GoAway(now, last & 0x7FFFFFFF, code, payload[8:])

    def _received(self, stream_id: int, data: bytes) -> None:
        partial = self._partial.setdefault(stream_id, bytearray())
        partial += data
        messages = self._messages.setdefault(stream_id, [])
        while len(partial) >= 5:
            length = struct.unpack(">I", partial[1:5])[0]
            if len(partial) < 5 + length:
                return
            messages.append(bytes(partial[5 : 5 + length]))
            del partial[: 5 + length]

    def _peer_settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - 5, 6):
            identifier, value = struct.unpack(">HI", payload[offset : offset + 6])
            if identifier == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream_id in self._stream_windows:
                    self._stream_windows[stream_id] += delta
            elif identifier == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
