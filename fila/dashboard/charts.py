"""Line charts as plain SVG geometry, computed on the server.

Drawing server-side keeps the page free of a charting library (no CDN, no build
step) and of inline script (the CSP forbids it): the template turns a `Chart` into
`<polyline>` elements, and live refresh simply swaps the fragment that holds it.
Only numbers reach the SVG, so there is nothing to escape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

WIDTH: Final = 600
HEIGHT: Final = 150
_PAD_LEFT: Final = 48
_PAD_BOTTOM: Final = 18
_PAD_TOP: Final = 8


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    css: str  # a class of dashboard.css: the colour lives there, not in the markup
    points: str  # "x,y x,y ..." for <polyline points=...>
    last: float | None


@dataclass(frozen=True, slots=True)
class Tick:
    pos: float
    label: str
    anchor: str = "middle"  # SVG text-anchor, so the edge labels stay inside the chart


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    unit: str
    series: tuple[Series, ...]
    y_ticks: tuple[Tick, ...]
    x_ticks: tuple[Tick, ...]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = _PAD_LEFT
    top: int = _PAD_TOP
    bottom: int = HEIGHT - _PAD_BOTTOM

    @property
    def empty(self) -> bool:
        return not any(s.points for s in self.series)


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= value (axis top)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        candidate: float = step * 10.0**exponent
        if candidate >= value:
            return candidate
    return 10.0 ** (exponent + 1)


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def line_chart(
    title: str,
    unit: str,
    now: float,
    span: float,
    lines: Sequence[tuple[str, str, Sequence[tuple[float, float]]]],
) -> Chart:
    """`lines` are (name, css class, [(monotonic time, value), ...]) over the last `span` s."""
    plot_w = WIDTH - _PAD_LEFT - 4
    plot_h = HEIGHT - _PAD_TOP - _PAD_BOTTOM
    top = nice_ceiling(max((v for _, _, pts in lines for _, v in pts), default=0.0))

    def x(at: float) -> float:
        return _PAD_LEFT + plot_w * (1 - min(max(now - at, 0.0), span) / span)

    def y(value: float) -> float:
        return _PAD_TOP + plot_h * (1 - value / top)

    series = tuple(
        Series(
            name=name,
            css=css,
            points=" ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in pts if now - at <= span),
            last=pts[-1][1] if pts else None,
        )
        for name, css, pts in lines
    )
    y_ticks = tuple(Tick(y(top * f), _fmt(top * f)) for f in (0.0, 0.5, 1.0))
    x_ticks = (
        Tick(x(now - span), f"-{_duration(span)}", "start"),
        Tick(x(now - span / 2), f"-{_duration(span / 2)}"),
        Tick(x(now), "now", "end"),
    )
    return Chart(title, unit, series, y_ticks, x_ticks)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.3g} min"


def span_for(oldest_age: float, retention: float, minimum: float = 60.0) -> float:
    """The time axis: the history there is (at least a minute), up to the retention.

    A dashboard started a minute ago would otherwise squeeze its only minute of data
    into the last tenth of a ten-minute axis.
    """
    return max(minimum, min(retention, oldest_age))
