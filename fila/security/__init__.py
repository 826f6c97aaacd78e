"""API keys, ACLs and the failed-attempt guard: who may call the broker, and on what.

The modules, each with one job:

    acl.py        permission kinds, queue patterns, coverage and the delegation rule
    apikeys.py    key generation, SHA-256 digests and the persisted key record
    keystore.py   `KeyStore`, where records live (local storage today, etcd in cluster mode)
    keyring.py    `Keyring`, the one owner of key state in memory, and `Caller`
    failures.py   `FailureGuard`, logging and slowing down peers that keep failing

Nothing here knows about gRPC; `fila.server.auth` (the interceptor) and
`fila.server.access` (what handlers call) adapt it to the edge.
"""
