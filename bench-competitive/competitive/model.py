"""The records the harness produces: one measurement per cell and repetition, one row
per cell in `summary.json`.

A row is the schema of issue 11 (`broker`, `mode`, `batching`, `workload`,
`connections`, `payload_bytes`, `value`, `unit`, `min`, `max`, `reps`, `conservation`)
plus a `note`: a row that could not be measured has `value` None and says why in
`conservation` and `note`, so a missing figure never looks like a number.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

Mode = Literal["durable", "buffered"]
Batching = Literal["none", "native"]

MODES: Final[tuple[Mode, ...]] = ("durable", "buffered")

RATE: Final = "msg/s"
MS: Final = "ms"
SECONDS: Final = "s"
MIB: Final = "MiB"
US_PER_MSG: Final = "us/msg"

OK: Final = "ok"
# Prefix of `conservation` for rows that were deliberately not measured (a broker
# without batching, an SDK without the batch calls); they are not failures.
NOT_AVAILABLE: Final = "not available"


@dataclass(frozen=True, slots=True, order=True)
class CellKey:
    """What identifies a row: the same key across repetitions is one cell."""

    broker: str
    mode: Mode
    batching: Batching
    workload: str
    connections: int | None
    payload_bytes: int | None


@dataclass(frozen=True, slots=True)
class Measurement:
    """One repetition of one cell: a value, or None with the reason in `status`."""

    key: CellKey
    value: float | None
    unit: str
    status: str = OK  # "ok", "failed: ...", "error: ...", "not available: ..."
    note: str = ""


@dataclass(frozen=True, slots=True)
class Row:
    broker: str
    mode: Mode
    batching: Batching
    workload: str
    connections: int | None
    payload_bytes: int | None
    value: float | None
    unit: str
    min: float | None
    max: float | None
    reps: int
    conservation: str
    note: str = ""

    @property
    def key(self) -> CellKey:
        return CellKey(
            self.broker,
            self.mode,
            self.batching,
            self.workload,
            self.connections,
            self.payload_bytes,
        )

    @property
    def available(self) -> bool:
        return not self.conservation.startswith(NOT_AVAILABLE)

    @property
    def failed(self) -> bool:
        """Measured (or tried) and not clean: a failed check or an error."""
        return self.available and self.conservation != OK

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        return cls(
            broker=str(data["broker"]),
            mode=data["mode"],
            batching=data["batching"],
            workload=str(data["workload"]),
            connections=data["connections"],
            payload_bytes=data["payload_bytes"],
            value=data["value"],
            unit=str(data["unit"]),
            min=data["min"],
            max=data["max"],
            reps=int(data["reps"]),
            conservation=str(data["conservation"]),
            note=str(data.get("note", "")),
        )
