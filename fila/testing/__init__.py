"""Harnesses that run Fila's processes for the tests and the benchmark; the broker never
uses them.

`server.ServerProcess` runs a real `fila-server` child and `etcd.EtcdCluster` real etcd
members; `children` holds what both need: a free port to listen on, and one way to end
a child. The package ships in the installed wheel because `fila-bench` (fila_bench)
starts brokers and etcd with it. Nothing in fila/ or fila_sdk/ imports it: only tests/,
fila_bench/ and scripts/ do (a layering contract in pyproject.toml, enforced by
tests/test_layers.py).
"""
