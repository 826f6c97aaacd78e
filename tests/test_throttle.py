"""Throttling through a real broker: runtime config over gRPC reaches the buckets, the
buckets reach GetStats and hold deliveries back, and they survive kill -9.

What the buckets do over time (rates, bursts, isolation between keys, rate changes,
multi-key messages) is specified exactly on a driven clock in tests/core/test_throttle.py;
nothing here depends on how fast this machine is. Every message's throttle keys come
from the queue's `on_enqueue`, read from the `th` header as a comma-separated list; its
fairness key from the `fk` header.
"""

from __future__ import annotations

from support.stubs import Fila, connect
from support.timing import TimedConsumer, enqueue_many

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2

T = 10.0

ON_ENQUEUE = """
function on_enqueue(m)
  local keys = {}
  for k in string.gmatch(m.headers.th or "", "[^,]+") do keys[#keys + 1] = k end
  return { fairness_key = m.headers.fk or "default", throttle_keys = keys }
end
"""


def set_config(fila: Fila, key: str, value: str) -> None:
    fila.admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value=value), timeout=T)


def make_queue(fila: Fila, name: str) -> None:
    fila.create_queue(name, on_enqueue=ON_ENQUEUE)


def backlog(fila: Fila, queue: str, count: int, th: str, fk: str = "default") -> list[str]:
    return enqueue_many(fila.svc, queue, count, headers={"th": th, "fk": fk})


def throttle_stats(fila: Fila, queue: str) -> dict[str, admin_pb2.PerThrottleKeyStats]:
    return {t.key: t for t in fila.stats(queue).per_throttle_stats}


def test_stats_report_tokens_rate_burst(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        make_queue(fila, "st")
        set_config(fila, "throttle.p", "0.01,10")
        set_config(fila, "throttle.q", "0.01,10")
        set_config(fila, "throttle.free", "3.5,2")
        stats = throttle_stats(fila, "st")
        assert set(stats) == {"p", "q", "free"}
        assert (stats["free"].rate_per_second, stats["free"].burst) == (3.5, 2.0)
        assert (stats["p"].rate_per_second, stats["p"].burst) == (0.01, 10.0)
        assert stats["p"].tokens == 10.0 and stats["free"].tokens == 2.0

        # 4 deliveries of messages needing p and q take 4 tokens from each
        backlog(fila, "st", 4, "p,q")
        with TimedConsumer(fila.channel, "st", auto_ack=True) as consumer:
            consumer.wait_count(4, T)
        stats = throttle_stats(fila, "st")
        for key in ("p", "q"):
            assert 6.0 <= stats[key].tokens < 6.1, (key, stats[key].tokens)
        assert stats["free"].tokens == 2.0

        # with 6 tokens left, only 6 of 10 more get out: the broker hands out what the
        # bucket allows in one go, and p refills 0.01/s (a 7th would take ~100 s)
        backlog(fila, "st", 10, "p")
        with TimedConsumer(fila.channel, "st", auto_ack=True) as consumer:
            consumer.wait_count(6, T)
            assert fila.stats("st").depth == 4
            assert consumer.count() == 6
        assert throttle_stats(fila, "st")["p"].tokens < 1.0


def test_throttle_survives_restart(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        make_queue(fila, "rs")
        set_config(fila, "throttle.rs", "2,1")
    server.kill()
    server.start()
    with connect(server.addr) as fila:
        stats = throttle_stats(fila, "rs")
        assert (stats["rs"].rate_per_second, stats["rs"].burst) == (2.0, 1.0)
        assert stats["rs"].tokens == 1.0  # a bucket starts full after a restart
        backlog(fila, "rs", 20, "rs")
        with TimedConsumer(fila.channel, "rs", auto_ack=True) as consumer:
            consumer.wait_count(3, T)  # the burst, then 2/s
            # in force: without it the broker would have leased 16 (its consumer_buffer) at once
            assert fila.stats("rs").depth >= 15
