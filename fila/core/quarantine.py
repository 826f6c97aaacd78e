"""Records that do not decode are set aside, not obeyed, skipped or fatal.

A record the broker cannot read (see `fila.core.stored` for what each kind must
be) used to
stop the broker at startup, or raise wherever it was read at run time. Either way
one bad record took good ones with it. Instead, it is moved as it was stored to
`X<original key>` (`fila.storage.keys.QUARANTINE`) in the same write that removes
it, logged with its key and the reason, and counted (`Quarantine.count`, exported
as `fila.storage.quarantined`). The rest of the broker carries on: the message is
gone from its queue, a queue whose record was set aside leaves its messages to be
reported as orphans, a lease or delay set aside leaves its message ready.

Nothing reads the `X` records again except an operator: `fila-server --repair`
lists them (and sets aside what recovery would), `--drop-quarantined` deletes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fila.core.stored import undecodable
from fila.storage import keys
from fila.storage.backend import Batch, Storage
from fila.storage.committer import Committer

log = logging.getLogger("fila.quarantine")

# Each start logs at most this many set-aside records one by one; the rest are counted.
_LOGGED_PER_RUN = 20


@dataclass(slots=True)
class Quarantine:
    """The set-aside records of this broker: how many are stored, and the log of new ones."""

    count: int = 0
    logged: int = 0
    reasons: list[tuple[bytes, str]] = field(default_factory=list)

    def set_aside(self, committer: Committer, key: bytes, raw: bytes, reason: str) -> None:
        """Moves the record under `key` to the quarantine, in the committer's next batch."""
        committer.put(keys.quarantine_key(key), raw)
        committer.delete(key)
        self.count += 1
        if len(self.reasons) < _LOGGED_PER_RUN:
            self.reasons.append((key, reason))
        if self.logged < _LOGGED_PER_RUN:
            self.logged += 1
            log.error(
                "a stored record does not decode; it was set aside, not served "
                "(see 'Damaged data' in docs/operations.md)",
                extra={"key": describe(key), "reason": reason, "bytes": len(raw)},
            )


def describe(key: bytes) -> str:
    """A record key for people: its tag and the rest as text when it is text."""
    tag, rest = key[:1], key[1:]
    if tag in (keys.MESSAGE, keys.LEASE, keys.DELAY) and len(rest) == 16:
        return f"{tag.decode()}{rest.hex()}"
    text = rest[:80].decode(errors="backslashreplace")
    return f"{tag.decode(errors='backslashreplace')}{text}" + ("..." if len(rest) > 80 else "")


@dataclass(slots=True)
class SweepReport:
    """What `sweep` found: records it set aside now (key, reason), and the quarantine's
    size after it (0 when it dropped them)."""

    set_aside: list[tuple[bytes, str]] = field(default_factory=list)
    held: int = 0
    dropped: int = 0


def sweep(storage: Storage, *, drop: bool) -> SweepReport:
    """`fila-server --repair`'s pass over records: sets aside every one recovery
    would (`fila.core.stored.undecodable`), in one synced write, then counts the
    quarantine, or deletes it when `drop`."""
    report = SweepReport()
    batch = Batch()
    for key, raw, reason in undecodable(storage):
        batch.put(keys.quarantine_key(key), raw)
        batch.delete(key)
        report.set_aside.append((key, reason))
    if batch.ops:
        storage.write(batch)
    held = [key for key, _ in storage.scan(keys.QUARANTINE)]
    if drop and held:
        batch = Batch()
        for key in held:
            batch.delete(key)
        storage.write(batch)
        report.dropped = len(held)
    else:
        report.held = len(held)
    storage.sync()
    return report
