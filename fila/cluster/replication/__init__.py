"""Replication of queues between cluster nodes (SPEC 9, "Replication"; docs/cluster.md).

`replicator.Replicator` is the protocol: the in-sync set, elections, epochs and
fencing, catch-up. It is a deterministic state machine that never awaits: it is fed
events (etcd records, membership, protocol messages, answers, ticks) and acts through
the ports in `ports` (etcd, the network, the local store, the broker). The broker
drives it with real adapters (`node`); the property tests drive the very same class
with an in-memory etcd and network (tests/support/replication_sim.py).
"""
