"""The competitive harness: Fila beside Redis, NATS JetStream, RabbitMQ and beanstalkd.

The folder listing is the architecture: `adapters/` (one module per broker behind the
small interface in `adapters/base.py`), `procs.py` (starting and stopping broker
processes), `resources.py` (their CPU and memory from /proc), `workloads.py` (the
closed loops), `conservation.py` (nothing lost, nothing duplicated), `stats.py`
(median, min, max, percentiles), `runner.py` (brokers one at a time, cells and
repetitions), `report/` (summary.json, RESULTS.md, charts) and `cli.py`.
"""
