"""Permissions: a kind of operation on the queues a pattern covers.

A permission is `(kind, pattern)`. Kinds follow SPEC section 3: `produce`
(enqueue in any form), `consume` (consume, ack, nack, their batch and stream
forms, lease extension) and `admin` (queue administration, runtime config,
redrive, stats, peek, purge). A pattern is one of

    *          every queue
    orders     exactly the queue "orders"
    orders.*   every queue whose name starts with "orders." (not "orders" itself)

A dead-letter queue belongs to its queue: a pattern covers `orders.dlq` exactly
when it covers `orders`. The DLQ is created and deleted with its queue, its
messages are that queue's failures and `Redrive` moves them back into it, so
whoever may consume or administer a queue needs its DLQ too, and having to grant
the DLQ separately would be a trap. The same rule keeps `acme.*` from covering
`acme.dlq`, the dead letters of queue `acme`, which `acme.*` does not cover,
although the name starts with `acme.`. An exact pattern may also name a DLQ
alone (`consume:orders.dlq`).

Delegation: a key holding `admin` on pattern P may grant only permissions whose
pattern lies inside P, i.e. covers no queue that P does not cover.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Final

from fila.core.errors import InvalidArgument, clip
from fila.wire import dlq_name, dlq_owner

# Same alphabet and bound as queue names (SPEC 2); a DLQ name may be 4 longer.
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._:\-]{1,259}")
ANY: Final = "*"
PREFIX_SUFFIX: Final = ".*"


class Kind(StrEnum):
    PRODUCE = "produce"
    CONSUME = "consume"
    ADMIN = "admin"

    @classmethod
    def parse(cls, text: str) -> Kind:
        try:
            return cls(text)
        except ValueError:
            raise InvalidArgument(
                f'unknown ACL kind "{clip(text)}": expected produce, consume or admin'
            ) from None


class _Shape(Enum):
    ANY = "any"
    EXACT = "exact"
    PREFIX = "prefix"


@dataclass(frozen=True, slots=True)
class Pattern:
    """A validated queue pattern; `text` is what the user wrote and what is stored."""

    text: str
    _shape: _Shape
    # The queue name (EXACT) or the name prefix including its final dot (PREFIX).
    _stem: str

    @classmethod
    def parse(cls, text: str) -> Pattern:
        if text == ANY:
            return cls(text, _Shape.ANY, "")
        if text.endswith(PREFIX_SUFFIX):
            stem = text[: -len(PREFIX_SUFFIX)]
            if _NAME_RE.fullmatch(stem):
                return cls(text, _Shape.PREFIX, stem + ".")
        elif _NAME_RE.fullmatch(text):
            return cls(text, _Shape.EXACT, text)
        raise InvalidArgument(
            f'ACL pattern "{clip(text)}" is malformed: use "*", a queue name, or "<prefix>.*" '
            "(queue names use letters, digits and . _ - :)"
        )

    def covers(self, queue: str) -> bool:
        """Whether this pattern grants access to `queue` (a queue's DLQ included)."""
        if self._shape is _Shape.ANY:
            return True
        if self._shape is _Shape.PREFIX:
            # A DLQ goes with its queue (names ending in .dlq are always DLQs).
            return (dlq_owner(queue) or queue).startswith(self._stem)
        return queue in (self._stem, dlq_name(self._stem))

    @property
    def is_any(self) -> bool:
        return self._shape is _Shape.ANY

    def contains(self, other: Pattern) -> bool:
        """Whether every queue `other` covers is covered by this pattern (delegation)."""
        if self._shape is _Shape.ANY:
            return True
        if other._shape is _Shape.ANY:
            return False
        if other._shape is _Shape.EXACT:
            # covers(name) implies covers(name + ".dlq") for both other shapes.
            return self.covers(other._stem)
        # other is a prefix: only a prefix that is a prefix of it contains it.
        return self._shape is _Shape.PREFIX and other._stem.startswith(self._stem)


@dataclass(frozen=True, slots=True)
class Permission:
    kind: Kind
    pattern: Pattern

    @classmethod
    def parse(cls, kind: str, pattern: str) -> Permission:
        return cls(Kind.parse(kind), Pattern.parse(pattern))

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.pattern.text}"


def parse_permissions(pairs: Iterable[tuple[str, str]]) -> tuple[Permission, ...]:
    """Validates every `(kind, pattern)`; duplicates are dropped, order is kept.

    Raises InvalidArgument for the first bad entry, before anything is applied."""
    seen: dict[Permission, None] = {}
    for kind, pattern in pairs:
        seen.setdefault(Permission.parse(kind, pattern), None)
    return tuple(seen)


def covers(permissions: Iterable[Permission], kind: Kind, queue: str) -> bool:
    return any(p.kind is kind and p.pattern.covers(queue) for p in permissions)


def may_delegate(admin_patterns: Iterable[Pattern], permission: Permission) -> bool:
    """Whether a holder of `admin` on `admin_patterns` may grant `permission`."""
    return any(p.contains(permission.pattern) for p in admin_patterns)
