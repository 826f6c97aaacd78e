"""The root of `fila`: global options, `--version`, and where failures become one
line. Command groups live in their own modules and are registered in `COMMANDS`;
adding a group is one module and one entry there.
"""

from __future__ import annotations

from typing import Any

import click
from click.exceptions import NoArgsIsHelpError

from fila import __version__
from fila.cli import acl, apikey, cluster, config, messages, queue, redrive
from fila.cli import health as health_module
from fila.cli.context import Group, Options
from fila.cli.errors import Failure, UsageFailure, broker_failure
from fila.dashboard.command import dashboard
from fila.wire import DEFAULT_ADDR
from fila_sdk import FilaError

COMMANDS: tuple[click.Command, ...] = (
    queue.queue,
    config.config,
    redrive.redrive,
    messages.enqueue,
    messages.tail,
    health_module.health,
    apikey.apikey,
    acl.acl,
    cluster.cluster,
    dashboard,
)


class _Root(Group):
    """Turns every expected failure into one line (see `fila.cli.errors`)."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as err:
            if isinstance(err, NoArgsIsHelpError):
                raise
            raise UsageFailure.from_click(err) from err

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FilaError as err:
            opts = ctx.find_object(Options)
            raise broker_failure(err, api_key_given=bool(opts and opts.api_key)) from err
        except click.UsageError as err:
            if isinstance(err, NoArgsIsHelpError):
                raise
            raise UsageFailure.from_click(err) from err
        except UnicodeError as err:  # text that cannot go on the wire or in a host name
            raise Failure(f"an argument is not valid text for the broker: {err}") from err
        except (ValueError, OverflowError) as err:  # a value past what the wire can carry
            raise Failure(f"a value is out of range: {err}") from err


@click.group(cls=_Root)
@click.version_option(__version__, "--version", prog_name="fila", message="%(prog)s %(version)s")
@click.option(
    "--addr",
    default=DEFAULT_ADDR,
    show_default=True,
    envvar="FILA_ADDR",
    help="Broker address host:port (or FILA_ADDR).",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
@click.option("--api-key", envvar="FILA_API_KEY", help="API key sent as a bearer token.")
@click.option("--tls", is_flag=True, help="Connect with TLS (implied by any certificate option).")
@click.option("--ca-cert", metavar="PATH", help="CA certificate (PEM) to verify the broker.")
@click.option("--client-cert", metavar="PATH", help="Client certificate (PEM) for mTLS.")
@click.option("--client-key", metavar="PATH", help="Client private key (PEM) for mTLS.")
@click.pass_context
def cli(
    ctx: click.Context,
    addr: str,
    as_json: bool,
    api_key: str | None,
    tls: bool,
    ca_cert: str | None,
    client_cert: str | None,
    client_key: str | None,
) -> None:
    """Administer a Fila broker, publish messages and follow queues."""
    ctx.obj = Options(addr, as_json, api_key, tls, ca_cert, client_cert, client_key)


for _command in COMMANDS:
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="fila")
