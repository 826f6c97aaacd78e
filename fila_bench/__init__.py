"""`fila-bench`: Fila's self-benchmark, and the tools CI uses to gate regressions on it.

`fila-bench system` starts real brokers (child processes) and drives them through
`fila_sdk` with closed-loop producers and workers; `aggregate` takes the median of
several runs and `compare` fails when a benchmark got worse than a threshold.
See docs/benchmarks.md for what each benchmark measures and why it is built that way.
"""
