"""The check every run ends with: exact counts, nothing lost, nothing duplicated.

A fast broker that loses or repeats jobs is not fast, so each cell records which jobs
the broker confirmed, which it delivered (by payload tag) and how many it still holds
when the consumers are done; `check` turns that into `"ok"` or a description of what
failed, which goes into the row's `conservation` field.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from competitive import payload
from competitive.model import OK

_EXAMPLES = 3


@dataclass(slots=True)
class Ledger:
    """What one cell saw: confirmed enqueues, deliveries, and malformed deliveries.

    Appending from many asyncio tasks is safe (one event loop, no awaits inside), and
    from the beanstalkd client's threads too (list.append is atomic under the GIL).
    """

    payload_bytes: int
    confirmed: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)

    def confirm(self, index: int) -> None:
        self.confirmed.append(index)

    def deliver(self, body: bytes) -> None:
        """Records a delivered payload by its tag; a bad one is kept for the report."""
        try:
            index = payload.index_of(body)
        except payload.PayloadError as exc:
            self.malformed.append(str(exc))
            return
        if len(body) != self.payload_bytes:
            self.malformed.append(f"job {index}: {len(body)} bytes, sent {self.payload_bytes}")
        self.delivered.append(index)


def check(ledger: Ledger, *, remaining: int, expected: int | None = None) -> str:
    """`"ok"`, or `"failed: ..."` naming every kind of discrepancy with examples.

    `remaining` is what the broker itself still reports (ready plus unacknowledged)
    after the consumers finished; it must be 0. `expected`, when given, is the number
    of jobs the workload meant to store and must equal the confirmed count.
    """
    return describe(
        confirmed=ledger.confirmed,
        delivered=ledger.delivered,
        malformed=ledger.malformed,
        remaining=remaining,
        expected=expected,
    )


def describe(
    *,
    confirmed: Collection[int],
    delivered: Iterable[int],
    malformed: Collection[str] = (),
    remaining: int = 0,
    expected: int | None = None,
) -> str:
    problems: list[str] = []
    confirmed_counts = Counter(confirmed)
    twice_confirmed = sorted(i for i, n in confirmed_counts.items() if n > 1)
    if twice_confirmed:
        problems.append(f"{len(twice_confirmed)} confirmed twice {_ex(twice_confirmed)}")
    if expected is not None and len(confirmed_counts) != expected:
        problems.append(f"{len(confirmed_counts)} of {expected} enqueues confirmed")
    counts = Counter(delivered)
    missing = sorted(confirmed_counts.keys() - counts.keys())
    duplicated = sorted(i for i, n in counts.items() if n > 1)
    unknown = sorted(counts.keys() - confirmed_counts.keys())
    if missing:
        problems.append(f"{len(missing)} lost {_ex(missing)}")
    if duplicated:
        problems.append(f"{len(duplicated)} delivered more than once {_ex(duplicated)}")
    if unknown:
        problems.append(f"{len(unknown)} delivered but never confirmed {_ex(unknown)}")
    if malformed:
        problems.append(f"{len(malformed)} malformed payloads ({'; '.join(list(malformed)[:2])})")
    if remaining:
        problems.append(f"broker still holds {remaining} after the drain")
    if not problems:
        return OK
    total = sum(counts.values())
    return f"failed: {len(confirmed_counts)} confirmed, {total} delivered: " + ", ".join(problems)


def _ex(indexes: list[int]) -> str:
    return "(e.g. " + ", ".join(str(i) for i in indexes[:_EXAMPLES]) + ")"
