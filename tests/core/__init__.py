"""The core's behaviour, specified in-process: one file per concern.

Each test drives the real broker (`Broker`, `Committer`, DRR, leases, timers, Lua
hooks) on in-memory storage and a manual clock through `support.core.CoreBroker`,
whose methods are the calls the gRPC edge makes. No server process, no sleeps: time
moves when a test moves it. The process-level tests in `tests/` prove the wiring
around this core (the gRPC edge, status codes, RocksDB, fsync, kill -9, SDK, CLI).
"""
