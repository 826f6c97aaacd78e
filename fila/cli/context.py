"""Global options and the command classes that give every command `--json`.

`--json` is accepted before the subcommand (`fila --json queue list`) and after it
(`fila queue list --json`): every command made through `command()` or a `Group`
gets the flag, so a new command group cannot forget it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class Options:
    """The root group's options, found by every command through its context."""

    addr: str
    as_json: bool
    api_key: str | None
    tls: bool
    ca_cert: str | None
    client_cert: str | None
    client_key: str | None


def options(ctx: click.Context) -> Options:
    opts = ctx.find_object(Options)
    assert opts is not None, "the root group always sets Options"
    return opts


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.obj = replace(options(ctx), as_json=True)


class Command(click.Command):
    """A command that also takes `--json` after its name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(
            click.Option(
                ["--json"],
                is_flag=True,
                expose_value=False,
                callback=_set_json,
                help="Print machine-readable JSON on stdout.",
            )
        )


class Group(click.Group):
    """A command group whose commands (and subgroups) are `Command`s and `Group`s."""

    command_class = Command
    group_class = type  # subgroups made with @group.group() are Groups too


def command(name: str | None = None, **kwargs: Any) -> Callable[[F], Command]:
    """`click.command` for a top-level command, with `--json`."""
    decorator: Callable[[F], Command] = click.command(name, cls=Command, **kwargs)
    return decorator


def group(name: str | None = None, **kwargs: Any) -> Callable[[F], Group]:
    """`click.group` for a top-level command group, with `--json` on its commands."""
    decorator: Callable[[F], Group] = click.group(name, cls=Group, **kwargs)
    return decorator
