"""Durations as people write them: `250ms`, `30s`, `5m`, `1h30m`, `2d`.

Whole numbers with a unit, one or more parts, as Go's and systemd's notations write
them. A plain whole number is milliseconds, the unit the wire and the broker's
configuration use (so `--visibility-timeout 30000` still means 30 s). Shared by the
CLI's duration flags and the broker's `retry_backoff = "fixed:30s"`.
"""

from __future__ import annotations

import re
from typing import Final

_UNIT_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART: Final = re.compile(r"(\d+)(ms|s|m|h|d)")
_WHOLE: Final = re.compile(r"(?:\d+(?:ms|s|m|h|d))+")
_PLAIN: Final = re.compile(r"\d+")
EXAMPLES: Final = "e.g. 250ms, 30s, 5m, 1h30m (a plain number is milliseconds)"


def parse_ms(text: str) -> int:
    """Milliseconds in `text`; ValueError naming the accepted forms otherwise."""
    spec = text.strip().lower()
    if _PLAIN.fullmatch(spec):
        ms = int(spec)
    elif _WHOLE.fullmatch(spec):
        ms = sum(int(number) * _UNIT_MS[unit] for number, unit in _PART.findall(spec))
    else:
        raise ValueError(f'"{text}" is not a duration: use a number and a unit, {EXAMPLES}')
    return ms


def format_ms(ms: int) -> str:
    """`5400000` -> `1h30m`: the shortest spelling `parse_ms` reads back."""
    if ms == 0:
        return "0s"
    parts = []
    for unit in ("d", "h", "m", "s", "ms"):
        count, ms = divmod(ms, _UNIT_MS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
