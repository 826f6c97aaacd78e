"""`RemoveNode`: a node that is gone for good leaves every queue's replica set.

Each replicated queue with a replica on the node gets that replica replaced by the
live node holding the fewest replicas (not one of its replicas already), and the node
is taken out of its in-sync set, in one transaction per queue that compares the
record it replaces (`Etcd.swap`), so a change the protocol makes meanwhile (an
election, an ISR change) is not undone: the removal is decided again on the new
record. The new replica catches up from the leader (a snapshot) and joins the ISR as
any follower does; a queue the node led is taken over by an in-sync follower once
the node's lease is gone, as on any leader's loss.

A queue whose only in-sync copy was on the node would lose acknowledged messages: the
call refuses (naming them) unless told to discard them, and then releases them, as
it releases the unreplicated queues the node owned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Final

from fila.cluster.etcd import Etcd
from fila.cluster.layout import Layout, Placement
from fila.cluster.mirror import Mirror
from fila.cluster.nodes import Nodes
from fila.cluster.placement import Placements
from fila.core.errors import InvalidArgument, Unavailable

log = logging.getLogger("fila.cluster.replication")

ATTEMPTS: Final = 5  # per queue, when the record changes under the removal


@dataclass(slots=True)
class Removal:
    moved: list[str] = field(default_factory=list)  # "queue=new node" ("queue=" if none)
    discarded: list[str] = field(default_factory=list)


def lost_with(placement: Placement, node_id: int) -> bool:
    """Whether `node_id` holds the only copy of every acknowledged message of the
    queue: it owns it unreplicated, or it is the only member of its in-sync set."""
    if not placement.replicated:
        return placement.node_id == node_id
    return tuple(placement.isr) == (node_id,)


async def remove_node(
    node_id: int,
    discard: bool,
    *,
    etcd: Etcd,
    layout: Layout,
    mirror: Mirror,
    nodes: Nodes,
    placements: Placements,
) -> Removal:
    if node_id <= 0:
        raise InvalidArgument(f"node_id must be a node's id (an integer > 0), got {node_id}")
    if nodes.get(node_id) is not None:
        raise InvalidArgument(
            f"node {node_id} is up: RemoveNode is for a node that is gone for good; stop "
            "it first (its queues then move to their in-sync followers)"
        )
    names = placements.names()
    lost = [name for name in names if _lost(placements, name, node_id)]
    if lost and not discard:
        shown = ", ".join(lost[:20]) + (f" and {len(lost) - 20} more" if len(lost) > 20 else "")
        raise InvalidArgument(
            f"node {node_id} holds the only in-sync copy of {len(lost)} queue(s): {shown}. "
            "Bring the node back, or remove it with discard_lost_queues "
            "(`fila cluster remove-node --discard-lost-queues`) to release them"
        )
    removal = Removal()
    for name in names:
        placement = placements.get(name)
        if placement is None:
            continue
        if lost_with(placement, node_id):
            revision = await etcd.delete(layout.queue(name))
            mirror.apply(layout.queue(name), None, revision)
            removal.discarded.append(name)
            log.warning("queue %s released: its only in-sync copy was on node %d", name, node_id)
        elif node_id in placement.replicas:
            removal.moved.append(
                await _replace(name, node_id, etcd, layout, mirror, nodes, placements)
            )
    log.info(
        "node %d removed: %d replica(s) moved, %d queue(s) released",
        node_id,
        len(removal.moved),
        len(removal.discarded),
    )
    return removal


def _lost(placements: Placements, name: str, node_id: int) -> bool:
    placement = placements.get(name)
    return placement is not None and lost_with(placement, node_id)


async def _replace(
    name: str,
    node_id: int,
    etcd: Etcd,
    layout: Layout,
    mirror: Mirror,
    nodes: Nodes,
    placements: Placements,
) -> str:
    key = layout.queue(name)
    for _ in range(ATTEMPTS):
        placement = placements.get(name)
        if placement is None or node_id not in placement.replicas:
            return f"{name}="
        live = [node.node_id for node in nodes.live() if node.node_id not in placement.replicas]
        chosen = placements.choose_followers(live, 0, 1)
        replicas = tuple(n for n in placement.replicas if n != node_id) + tuple(chosen)
        isr = tuple(n for n in placement.isr if n != node_id)
        record = replace(
            placement, replicas=replicas, isr=isr, version=placement.version + 1, raw=b""
        )
        swapped = await etcd.swap(key, placement.stored(), record.encode())
        entry = swapped.entry
        if entry is not None:
            mirror.apply(key, entry.value, entry.mod_revision)
        else:
            mirror.apply(key, None, swapped.revision)
        if swapped.swapped:
            return f"{name}={chosen[0]}" if chosen else f"{name}="
    raise Unavailable(
        f"queue {name} kept changing while node {node_id} was being removed; call again"
    )
