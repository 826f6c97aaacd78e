"""Durations on the command line: `250ms`, `30s`, `5m`, `1h30m`, `2d`.

Whole numbers with a unit, one or more parts, as Go's and systemd's notations
write them; a bare number is refused because its unit would be a guess.
"""

from __future__ import annotations

import re
from typing import Final

import click

_UNIT_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART: Final = re.compile(r"(\d+)(ms|s|m|h|d)")
_WHOLE: Final = re.compile(r"(?:\d+(?:ms|s|m|h|d))+")
EXAMPLES: Final = "e.g. 250ms, 30s, 5m, 1h30m"


def parse_ms(text: str) -> int:
    """Milliseconds in `text`; ValueError naming the accepted forms otherwise."""
    spec = text.strip().lower()
    if not _WHOLE.fullmatch(spec):
        raise ValueError(f'"{text}" is not a duration: use a number and a unit, {EXAMPLES}')
    return sum(int(number) * _UNIT_MS[unit] for number, unit in _PART.findall(spec))


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


def option_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A click option callback: the option's duration in milliseconds (None if absent)."""
    if value is None:
        return None
    try:
        return parse_ms(value)
    except ValueError as err:
        raise click.BadParameter(str(err), ctx, param) from err
