"""Message ids: UUIDv7 that are strictly increasing, even across restarts.

Recovery rebuilds each fairness key's FIFO order by scanning stored messages
in id order, so ids must sort exactly in enqueue order. A generator that bumps
the timestamp to stay unique (as some libraries do) runs ahead of the clock
above 1,000 ids/s, and after a restart new ids can sort before older ones. This
one follows RFC 9562 section 6.2 method 1 instead: the 12 `rand_a` bits are a
counter, seeded randomly (top bit clear) each new millisecond and incremented
within one; only if it overflows (2,048 ids in one millisecond) does the
timestamp advance. Recovery seeds the generator with the largest stored id.

The random bits come from a PRNG seeded from the OS, not from `os.urandom` per
id: uniqueness comes from the counter, and two system calls per message cost
more than the rest of the id together.
"""

from __future__ import annotations

import os
import random

from fila.clock import Clock

_COUNTER_BITS = 12
_COUNTER_MAX = (1 << _COUNTER_BITS) - 1
_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62
_TAIL_MASK = (1 << 62) - 1


class IdGenerator:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._last_ms = 0
        self._counter = 0
        self._random = random.Random(os.urandom(16))

    def advance_past(self, raw_id: bytes) -> None:
        """Makes every later id sort after `raw_id` (16 bytes, a stored UUIDv7)."""
        value = int.from_bytes(raw_id, "big")
        ms = value >> 80
        counter = (value >> 64) & _COUNTER_MAX
        if (ms, counter) > (self._last_ms, self._counter):
            self._last_ms, self._counter = ms, counter

    def next(self) -> tuple[bytes, str]:
        """The next id as (16 raw bytes for storage keys, canonical string for the wire)."""
        now = self._clock.now_ms()
        if now > self._last_ms:
            self._last_ms = now
            self._counter = self._random.getrandbits(_COUNTER_BITS - 1)
        elif self._counter < _COUNTER_MAX:
            self._counter += 1
        else:
            self._last_ms += 1
            self._counter = 0
        tail = self._random.getrandbits(62)
        value = (self._last_ms << 80) | _VERSION_7 | (self._counter << 64) | _VARIANT | tail
        raw = value.to_bytes(16, "big")
        h = raw.hex()
        return raw, f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_id(message_id: str) -> bytes | None:
    """The 16 raw bytes of a canonical UUID string, or None if it is not one."""
    if len(message_id) != 36 or message_id[8] != "-" or message_id[23] != "-":
        return None
    try:
        raw = bytes.fromhex(message_id.replace("-", ""))
    except ValueError:
        return None
    return raw if len(raw) == 16 else None


def enqueued_ms(raw_id: bytes) -> int:
    """The millisecond timestamp a UUIDv7 carries (when the message was enqueued)."""
    return int.from_bytes(raw_id[:6], "big")
