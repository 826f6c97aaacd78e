"""Duration flags: every one takes `250ms`, `30s`, `5m`, `1h30m`, `2d`
(see `fila.durations`); a plain number keeps the unit the flag always had
(milliseconds, or seconds for the refresh intervals of watch mode and the dashboard).
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

import click

from fila.durations import EXAMPLES, format_ms, parse_ms

__all__ = ["EXAMPLES", "Duration", "format_ms", "option_ms", "parse_ms"]

_PLAIN_SECONDS: Final = re.compile(r"\d+(\.\d+)?|\.\d+")


class Duration(click.ParamType):  # type: ignore[type-arg]
    """A duration option: milliseconds (int), or with `seconds=True` seconds (float,
    where a plain number, fractions allowed, is seconds as before). `min_ms`/`max_ms`
    bound it."""

    name = "duration"

    def __init__(self, *, min_ms: int = 0, max_ms: int | None = None, seconds: bool = False):
        self.min_ms = min_ms
        self.max_ms = max_ms
        self.seconds = seconds

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # a default given as a number
        text = value.strip()
        try:
            if self.seconds and _PLAIN_SECONDS.fullmatch(text):
                seconds = float(text)
                if math.isnan(seconds) or math.isinf(seconds):
                    raise ValueError(f'"{value}" is not a number of seconds')
                ms = math.ceil(seconds * 1000)
            else:
                ms = parse_ms(text)
        except ValueError as err:
            self.fail(str(err), param, ctx)
        if ms < self.min_ms or (self.max_ms is not None and ms > self.max_ms):
            upper = f" and {format_ms(self.max_ms)}" if self.max_ms is not None else ""
            word = "between" if self.max_ms is not None else "at least"
            self.fail(f'"{value}" must be {word} {format_ms(self.min_ms)}{upper}', param, ctx)
        return ms / 1000 if self.seconds else ms


def option_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A click option callback: the option's duration in milliseconds (None if absent)."""
    if value is None:
        return None
    try:
        return parse_ms(value)
    except ValueError as err:
        raise click.BadParameter(str(err), ctx, param) from err
