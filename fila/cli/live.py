"""Watch mode: a view refreshed every interval until Ctrl-C.

On a terminal the view is redrawn in place (rich `Live`); under `--json` each
refresh is one JSON line (JSON Lines), so a script can follow it; on anything else
(a pipe, a file) each refresh is printed after the previous one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext

import click
from rich.console import RenderableType
from rich.live import Live

from fila.cli.output import as_json, console

# One refresh: what `--json` prints, and what a human sees.
Frame = tuple[object, RenderableType]


def watch(
    ctx: click.Context,
    frame: Callable[[], Frame],
    *,
    interval: float,
    iterations: int | None,
) -> None:
    """Shows `frame()` every `interval` seconds, `iterations` times (None: until Ctrl-C)."""
    json_lines = as_json(ctx)
    out = console()
    live = None if json_lines or not out.is_terminal else Live(console=out, auto_refresh=False)
    shown = 0
    due = time.monotonic()
    try:
        with live or nullcontext():
            while True:
                data, view = frame()
                if json_lines:
                    click.echo(json.dumps(data))
                elif live is not None:
                    live.update(view, refresh=True)
                else:
                    out.print(view)
                    out.print()
                shown += 1
                if iterations is not None and shown >= iterations:
                    return
                # Keep the cadence, but never catch up with a burst after a slow frame.
                due = max(due + interval, time.monotonic())
                time.sleep(max(0.0, due - time.monotonic()))
    except KeyboardInterrupt:
        return  # Ctrl-C is how a watch ends
