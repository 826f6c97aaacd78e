"""The dashboard's pure parts, without a browser: rates, shares, charts, option rules,
signed tokens. Fast, and they pin down the edge cases the browser tests cannot reach
(a broker restart between two samples, a key that appears mid-window)."""

from __future__ import annotations

import time

import click
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from fila.dashboard.app import Settings
from fila.dashboard.auth import TokenGate
from fila.dashboard.broker import Connection
from fila.dashboard.charts import line_chart, nice_ceiling, span_for
from fila.dashboard.command import is_loopback, parse_listen
from fila.dashboard.csrf import CsrfTokens
from fila.dashboard.history import (
    Counters,
    KeyStat,
    QueueHistory,
    QueueSample,
    key_shares,
)
from fila.dashboard.queue_form import Changes, changes, digests, shown_values
from fila.dashboard.render import error_preview, until
from fila.dashboard.views.apikeys import parse_acl
from fila.v1 import admin_pb2
from fila.wire import UNLIMITED_ATTEMPTS, dlq_owner


def sample(at: float, enq: int, deliv: int, keys: tuple[KeyStat, ...] = ()) -> QueueSample:
    return QueueSample(
        at=at,
        depth=0,
        in_flight=0,
        consumers=0,
        counters=Counters(enq, deliv, deliv, 0, 0, 0),
        keys=keys,
    )


def test_rates_average_over_the_window() -> None:
    history = QueueHistory(retention=600)
    for i in range(11):
        history.add(sample(float(i), enq=10 * i, deliv=5 * i))
    rates = history.rates(window=4)
    assert rates is not None
    assert (rates.enqueued, rates.delivered, rates.span) == (10.0, 5.0, 4.0)


def test_a_broker_restart_is_a_gap_not_a_spike() -> None:
    history = QueueHistory(retention=600)
    history.add(sample(0, 1000, 1000))
    history.add(sample(1, 1100, 1100))
    history.add(sample(2, 5, 5))  # counters went back: the broker restarted
    history.add(sample(3, 25, 15))
    assert [p.enqueued for p in history.rate_series()] == [100.0, 20.0]
    rates = history.rates(window=10)
    assert rates is not None and (rates.enqueued, rates.span) == (20.0, 1.0)


def test_retention_drops_old_samples() -> None:
    history = QueueHistory(retention=5)
    for i in range(20):
        history.add(sample(float(i), i, i))
    assert [s.at for s in history.samples] == [14, 15, 16, 17, 18, 19]


def test_per_key_stats_are_kept_for_the_share_window_only() -> None:
    history = QueueHistory(retention=600, key_window=3)
    for i in range(10):
        history.add(sample(float(i), i, i, (KeyStat("a", 1, 0, 1, i),)))
    assert [bool(s.keys) for s in history.samples] == [False] * 6 + [True] * 4
    assert [s.at for s in history.samples] == [float(i) for i in range(10)]
    assert history.key_shares(3)[0].delivered_recent == 3


def test_key_shares_compare_deliveries_with_weights_of_backlogged_keys() -> None:
    samples = [
        sample(0, 0, 0, (KeyStat("a", 50, 0, 1, 100), KeyStat("b", 50, 0, 3, 300))),
        sample(1, 0, 0, (KeyStat("a", 40, 0, 1, 110), KeyStat("b", 20, 0, 3, 330))),
        # "a" drained and left the ring; "c" appeared mid-window with earlier deliveries.
        sample(2, 0, 0, (KeyStat("b", 10, 0, 3, 340), KeyStat("c", 5, 0, 1, 70))),
        sample(3, 0, 0, (KeyStat("b", 5, 0, 3, 345), KeyStat("c", 4, 0, 1, 75))),
    ]
    shares = {s.key: s for s in key_shares(samples)}
    assert shares["a"].delivered_recent == 10 and not shares["a"].active
    assert shares["a"].weight_share is None and shares["a"].pending == 0
    assert shares["b"].delivered_recent == 45
    assert shares["c"].delivered_recent == 5  # counted from its first appearance
    assert shares["b"].delivery_share == pytest.approx(45 / 60)
    assert shares["b"].weight_share == pytest.approx(3 / 4)
    assert shares["c"].weight_share == pytest.approx(1 / 4)


def test_charts_scale_to_a_round_top_and_the_history_there_is() -> None:
    assert [nice_ceiling(v) for v in (0, 0.3, 7, 10, 11, 260, 4100)] == [
        1.0,
        0.5,
        10.0,
        10.0,
        20.0,
        500.0,
        5000.0,
    ]
    assert span_for(5, 600) == 60 and span_for(300, 600) == 300 and span_for(900, 600) == 600
    chart = line_chart(
        "t", "u", now=100.0, span=60.0, lines=[("x", "c", [(40.0, 0.0), (100.0, 8.0)])]
    )
    assert chart.series[0].points.split() == ["48.0,132.0", "596.0,32.8"]  # top 10
    assert [t.label for t in chart.x_ticks] == ["-60 s", "-30 s", "now"]


@pytest.mark.parametrize(
    ("listen", "host", "port", "loopback"),
    [
        ("127.0.0.1:8080", "127.0.0.1", 8080, True),
        ("localhost:1", "localhost", 1, True),
        ("[::1]:8080", "::1", 8080, True),
        ("0.0.0.0:8080", "0.0.0.0", 8080, False),
        ("dash.example:80", "dash.example", 80, False),
    ],
)
def test_listen_addresses(listen: str, host: str, port: int, loopback: bool) -> None:
    assert parse_listen(listen) == (host, port)
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    "bad", ["8080", ":8080", "host:", "host:0", "host:70000", "host:x", "host:\uff18\uff10"]
)
def test_bad_listen_addresses(bad: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_listen(bad)


@pytest.mark.parametrize(
    ("token", "allow_writes", "read_only"),
    [(None, False, True), ("t" * 16, False, False), (None, True, False), ("t" * 16, True, False)],
)
def test_without_a_token_or_the_flag_the_dashboard_is_read_only(
    token: str | None, allow_writes: bool, read_only: bool
) -> None:
    settings = Settings(
        Connection("localhost:5555"), 8080, True, auth_token=token, allow_writes=allow_writes
    )
    assert settings.read_only is read_only


def test_session_cookie_is_not_the_token_and_tokens_are_bound_to_their_cookie() -> None:
    gate = TokenGate("a-long-enough-token", b"k" * 32)
    assert gate.token_matches("a-long-enough-token") and not gate.token_matches("a-long")
    assert "a-long-enough-token" not in gate.session_value
    assert TokenGate("a-long-enough-token", b"j" * 32).session_value != gate.session_value
    tokens = CsrfTokens(b"k" * 32)
    assert tokens.valid("cookie-1", tokens.token_for("cookie-1"))
    assert not tokens.valid("cookie-2", tokens.token_for("cookie-1"))
    assert not tokens.valid("", tokens.token_for(""))


def test_acl_text_and_dlq_names() -> None:
    assert parse_acl("consume orders\n\n  admin  orders.*  \n") == (
        [("consume", "orders"), ("admin", "orders.*")],
        "",
    )
    assert parse_acl("consume\n")[1].startswith("line 1:")
    assert dlq_owner("orders.dlq") == "orders" and dlq_owner(".dlq") is None
    assert dlq_owner("orders") is None


def test_the_queue_form_sends_only_the_settings_that_changed() -> None:
    script = "function on_enqueue(msg)\n  return {}\nend\n"
    config = admin_pb2.QueueConfig(
        on_enqueue_script=script,
        visibility_timeout_ms=30_000,
        max_attempts=UNLIMITED_ATTEMPTS,
        retry_backoff="exponential",
    )
    values = shown_values(config)
    assert (values["visibility_timeout_ms"], values["max_attempts"]) == ("30s", "unlimited")
    shown = digests(values)
    # What a browser sends back untouched: the textarea's lines end in CRLF.
    untouched = {**values, "on_enqueue_script": script.replace("\n", "\r\n")}
    assert changes(untouched, shown) == Changes()
    edited = {**untouched, "visibility_timeout_ms": "1m30s", "on_failure_script": "x\r\ny"}
    wanted = changes(edited, shown)
    assert wanted == Changes(visibility_timeout_ms=90_000, on_failure="x\ny")
    assert wanted.names() == ["visibility timeout", "on_failure script"]
    # Emptied, a script is sent as "" (the hook is removed); a field not sent is kept.
    assert changes({"on_enqueue_script": ""}, shown) == Changes(on_enqueue="")
    assert changes({"max_attempts": " 7 "}, shown) == Changes(max_attempts=7)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("visibility_timeout_ms", "soon", "Visibility timeout:"),
        ("max_attempts", "0", "Max attempts: 0 attempts"),
        ("max_attempts", "many", 'Max attempts: "many" is not a number'),
    ],
)
def test_the_queue_form_names_a_field_it_cannot_read(field: str, value: str, words: str) -> None:
    with pytest.raises(ValueError, match=f"^{words}"):
        changes({field: value}, {})


def test_errors_are_previewed_by_their_first_line_and_times_until_are_counted_down() -> None:
    assert error_preview("boom") == ("boom", False)
    assert error_preview("boom\n  at line 3") == ("boom", True)
    assert error_preview("x" * 200) == ("x" * 120 + "…", True)
    soon = Timestamp()
    soon.FromMilliseconds(int(time.time() * 1000) + 90_500)
    assert until(soon) in ("in 1m31s", "in 1m30s")
    soon.FromMilliseconds(int(time.time() * 1000) - 1)
    assert until(soon) == "now" and until(Timestamp()) == "—"
