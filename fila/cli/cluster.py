"""`fila cluster status`: the nodes of a cluster-mode broker (SPEC 9), as the node at
`--addr` sees them: which are up, where they listen, and how many queues each owns.

A node that is down but still owns queues is listed (its queues wait for it); a node
that is down and owns nothing is not (nothing depends on it). A single-node broker
says so.
"""

from __future__ import annotations

import click
from rich.table import Table

from fila.cli import raw
from fila.cli.connection import connect
from fila.cli.context import group
from fila.cli.output import emit


@group()
def cluster() -> None:
    """See the nodes of a cluster-mode broker."""


@cluster.command("status")
@click.pass_context
def cluster_status(ctx: click.Context) -> None:
    """List the cluster's nodes: up or down, address, queues owned."""
    reply = raw.cluster_status(connect(ctx))
    if not reply.enabled:
        emit(
            ctx,
            {"enabled": False, "node_id": 0, "nodes": []},
            "Not in cluster mode: this broker is a single node.",
        )
        return
    nodes = [
        {
            "node_id": n.node_id,
            "advertise_addr": n.advertise_addr,
            "up": n.up,
            "queues": n.queue_count,
        }
        for n in reply.nodes
    ]
    table = Table(title=None)
    for header in ("node", "address", "state", "queues"):
        table.add_column(header, justify="right" if header in ("node", "queues") else "left")
    for n in reply.nodes:
        state = "up" if n.up else "DOWN"
        table.add_row(str(n.node_id), n.advertise_addr or "-", state, str(n.queue_count))
    up = sum(1 for n in nodes if n["up"])
    summary = f"{up} of {len(nodes)} nodes up (as seen by node {reply.node_id})"
    emit(ctx, {"enabled": True, "node_id": reply.node_id, "nodes": nodes}, table, summary)
