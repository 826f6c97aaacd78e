"""Watch mode: a view refreshed every interval until Ctrl-C.

On a terminal the view is redrawn in place (rich `Live`); under `--json` each
refresh is one JSON line (JSON Lines), so a script can follow it; on anything else
(a pipe, a file) each refresh is printed after the previous one.

A watch outlives the broker it watches: while the broker is unreachable (restarting,
failing over) each refresh says so, on the terminal in place of the view and
elsewhere on stderr (stdout keeps only views), and the next refresh tries again.
Any other error (a queue that does not exist, a refused key) ends the watch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext

import click
from rich.console import RenderableType
from rich.live import Live
from rich.text import Text

from fila.cli.output import as_json, console
from fila_sdk import DeadlineExceededError, UnavailableError

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
                try:
                    data, view = frame()
                except (UnavailableError, DeadlineExceededError) as err:
                    note = f"broker unreachable ({err.message}); retrying every {interval:g}s"
                    if live is not None:
                        live.update(Text(note, style="yellow"), refresh=True)
                    else:
                        click.echo(f"fila: warning: {note}", err=True)
                else:
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
