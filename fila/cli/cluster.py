"""`fila cluster`: the nodes of a cluster-mode broker (SPEC 9).

`status` shows them as the node at `--addr` sees them: which are up, where they
listen, how many queues each leads, and, with replicated queues, how many each
follows and is in sync for. A node that is down but still holds queues is listed
(its queues wait for it, or moved to a follower); a node that is down and holds
nothing is not. A single-node broker says so.

`remove-node N` forgets a node that is gone for good: every replicated queue with a
replica on it gets another live node instead, which catches up and joins the queue's
in-sync set. A queue whose only in-sync copy was on it is refused unless
`--discard-lost-queues` (then it is released: its messages are gone).
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
    """See and manage the nodes of a cluster-mode broker."""


@cluster.command("status")
@click.pass_context
def cluster_status(ctx: click.Context) -> None:
    """List the cluster's nodes: up or down, address, queues led (and followed)."""
    reply = raw.cluster_status(connect(ctx))
    if not reply.enabled:
        emit(
            ctx,
            {"enabled": False, "node_id": 0, "nodes": []},
            "Not in cluster mode: this broker is a single node.",
        )
        return
    replicated = any(n.follower_count for n in reply.nodes)
    nodes = [
        {
            "node_id": n.node_id,
            "advertise_addr": n.advertise_addr,
            "up": n.up,
            "queues": n.queue_count,
            **({"following": n.follower_count, "in_sync": n.in_sync_count} if replicated else {}),
        }
        for n in reply.nodes
    ]
    table = Table(title=None)
    headers = (
        "node",
        "address",
        "state",
        "queues",
        *(("following", "in sync") if replicated else ()),
    )
    for header in headers:
        table.add_column(header, justify="left" if header in ("address", "state") else "right")
    for n in reply.nodes:
        state = "up" if n.up else "DOWN"
        row = [str(n.node_id), n.advertise_addr or "-", state, str(n.queue_count)]
        if replicated:
            row += [str(n.follower_count), str(n.in_sync_count)]
        table.add_row(*row)
    up = sum(1 for n in nodes if n["up"])
    summary = f"{up} of {len(nodes)} nodes up (as seen by node {reply.node_id})"
    emit(ctx, {"enabled": True, "node_id": reply.node_id, "nodes": nodes}, table, summary)


@cluster.command("remove-node")
@click.argument("node_id", type=click.IntRange(min=1))
@click.option(
    "--discard-lost-queues",
    is_flag=True,
    help="Also release the queues whose only in-sync copy was on the node (their "
    "messages are lost); without it such queues make the command fail, named.",
)
@click.pass_context
def remove_node(ctx: click.Context, node_id: int, discard_lost_queues: bool) -> None:
    """Forget node NODE_ID, gone for good: its replicas move to other live nodes."""
    reply = raw.remove_node(connect(ctx), node_id, discard_lost_queues)
    moved = [dict(zip(("queue", "node"), item.split("=", 1), strict=True)) for item in reply.moved]
    lines = [f"Removed node {node_id}."]
    lines += [
        f"  {m['queue']}: replica now on node {m['node']}"
        if m["node"]
        else f"  {m['queue']}: no live node free for a replica"
        for m in moved
    ]
    lines += [
        f"  {name}: released (its only in-sync copy was on node {node_id})"
        for name in reply.discarded
    ]
    emit(
        ctx,
        {
            "node_id": node_id,
            "moved": [
                {"queue": m["queue"], "node": int(m["node"]) if m["node"] else None} for m in moved
            ],
            "discarded": list(reply.discarded),
        },
        "\n".join(lines),
    )
