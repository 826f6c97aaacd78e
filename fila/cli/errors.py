"""How the CLI fails: one `fila: error: ...` line on stderr and a non-zero exit.

Broker errors keep the broker's own wording (it names the offending thing) and gain
a hint where the fix lies on the user's side (an API key, a permission). Usage
errors (a bad option value, a missing argument) exit 2 as click's do, but on one
line too, pointing at `--help` instead of printing the usage block.
"""

from __future__ import annotations

from typing import Any

import click

from fila_sdk import FilaError, PermissionDeniedError, UnauthenticatedError


class Failure(click.ClickException):
    """An expected failure: one line on stderr, exit status 1, no traceback."""

    def show(self, file: Any = None) -> None:
        click.echo(f"fila: error: {' '.join(self.message.split())}", err=True)


class UsageFailure(Failure):
    """A command line click could not parse; exit status 2 like click's own."""

    exit_code = 2

    @classmethod
    def from_click(cls, err: click.UsageError) -> UsageFailure:
        message = err.format_message()
        if err.ctx is not None:
            message += f" (see '{err.ctx.command_path} --help')"
        return cls(message)


def broker_failure(err: FilaError, *, api_key_given: bool) -> Failure:
    """A broker error as a one-line failure, with the fix when it is the caller's."""
    if isinstance(err, UnauthenticatedError):
        if api_key_given:
            hint = "check the key passed with --api-key or FILA_API_KEY"
        else:
            hint = "the broker requires an API key: pass --api-key KEY or set FILA_API_KEY"
        return Failure(f"{err.message}; {hint}")
    if isinstance(err, PermissionDeniedError):
        return Failure(
            f"{err.message}; the API key in use (--api-key or FILA_API_KEY) is not allowed "
            "to do this"
        )
    return Failure(err.message)
