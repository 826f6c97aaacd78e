"""The web dashboard in a real browser: headless Debian `chromium` driven by Playwright.

Every test starts real processes: a `fila-server` (the `server_factory` fixture) with
a generated workload, and the dashboard through `python -m fila.dashboard`, exactly as
an operator runs it. The browser waits on page conditions with Playwright's
expectations and deadlines, never on sleeps. Broker-side effects are checked over
gRPC, and runtime config through the real `fila` CLI.

Screenshots for the README are taken under a noisy-and-quiet-tenant load by
`test_queue_page_shows_shares_matching_weights`; with FILA_UPDATE_SCREENSHOTS=1 they
are written to docs/images/ (otherwise to the test's temporary directory, so a test
run does not modify tracked files).
"""

from __future__ import annotations

import contextlib
import os
import queue as stdlib_queue
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from support import ServerFactory, ServerProcess
from support.dashboard import DashboardProcess
from support.stubs import ConsumeStream, Fila, connect

from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc


def _missing(reason: str) -> None:
    """Skip where the browser stack is not installed; in CI (.ci/run installs it) fail."""
    if os.environ.get("CI"):
        raise RuntimeError(f"{reason} (CI must install it: see .ci/run)")
    pytest.skip(reason, allow_module_level=True)


try:
    import jinja2  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError as err:
    _missing(f"{err.name} is not installed: pip install -e '.[dashboard]' playwright")

CHROMIUM = shutil.which("chromium") or ""
if not CHROMIUM:
    _missing("Debian's chromium is not installed: apt-get install chromium")

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Page conditions get this long: the machine is shared, and a sample is 0.5 s apart.
WAIT_MS = 30_000
REPO = Path(__file__).resolve().parent.parent
# What a dashboard needs to change anything without `--auth-token` (read-only otherwise).
WRITES_ON_LOOPBACK = ["--allow-writes-on-loopback"]

TENANT_HOOK = """
function on_enqueue(msg)
  return { fairness_key = msg.headers.tenant or "default",
           weight = tonumber(msg.headers.weight or "1") }
end
"""
DLQ_HOOK = 'function on_failure(msg) return { action = "dlq" } end'

expect.set_options(timeout=WAIT_MS)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser context (no cookies) per test; fails the test on a CSP violation."""
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(WAIT_MS)
    new_page = context.new_page()
    problems: list[str] = []
    new_page.on(
        "console",
        lambda msg: problems.append(msg.text) if "Content Security Policy" in msg.text else None,
    )
    new_page.on("pageerror", lambda exc: problems.append(f"script error: {exc}"))
    yield new_page
    context.close()
    assert not problems, problems


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One broker for the tests that only need queues of their own (each test names its
    own), so they do not each pay for starting one."""
    broker = ServerProcess(tmp_path_factory.mktemp("shared-broker") / "data").start()
    yield broker
    if broker.running:
        broker.stop()


@pytest.fixture(scope="module")
def shared_dash(
    shared_broker: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DashboardProcess]:
    """A dashboard with writes enabled on `shared_broker`, for the same tests."""
    log = tmp_path_factory.mktemp("shared-dashboard") / "dashboard.log"
    dash = DashboardProcess(shared_broker.addr, log, extra_args=WRITES_ON_LOOPBACK).start()
    yield dash
    dash.stop()


DashboardFactory = Callable[..., DashboardProcess]


@pytest.fixture
def dashboard_factory(tmp_path: Path) -> Iterator[DashboardFactory]:
    made: list[DashboardProcess] = []

    def make(broker_addr: str, *, start: bool = True, **kwargs: Any) -> DashboardProcess:
        dash = DashboardProcess(broker_addr, tmp_path / f"dashboard{len(made)}.log", **kwargs)
        made.append(dash)
        return dash.start() if start else dash

    yield make
    for dash in made:
        dash.stop()


# ----------------------------------------------------------------------------- workload


def enqueue_many(
    fila: Fila, queue: str, count: int, headers: dict[str, str], payload: bytes = b"job"
) -> None:
    for start in range(0, count, 1000):
        batch = [
            service_pb2.EnqueueRequest(queue=queue, headers=headers, payload=payload)
            for _ in range(min(1000, count - start))
        ]
        reply = fila.svc.EnqueueBatch(service_pb2.EnqueueBatchRequest(messages=batch), timeout=60)
        assert all(r.HasField("message_id") for r in reply.results)


def dead_letter(fila: Fila, queue: str, count: int) -> None:
    """Enqueue `count` messages and nack each into the DLQ (the queue's hook says dlq)."""
    for i in range(count):
        fila.enqueue(queue, f"failed-{i}".encode(), {"n": str(i)})
    with ConsumeStream(fila.svc, queue) as stream:
        for message in stream.take(count, timeout=30):
            fila.nack(queue, message.id, "handler raised")


class AckingConsumer(threading.Thread):
    """A StreamConsume consumer that acks everything, up to `limit` deliveries.

    `rate` paces it (deliveries per second) so that a backlog lasts for the length of
    a test: it shapes the workload, nothing waits on it.
    """

    def __init__(
        self,
        svc: service_pb2_grpc.FilaServiceStub,
        queue: str,
        limit: int,
        rate: float | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.svc = svc
        self.queue = queue
        self.limit = limit
        self.rate = rate
        self.delivered = 0
        self.error: grpc.RpcError | None = None
        self._requests: stdlib_queue.Queue[service_pb2.StreamConsumeRequest | None] = (
            stdlib_queue.Queue()
        )
        self._halt = threading.Event()
        self._call: Any = None

    def run(self) -> None:
        self._requests.put(
            service_pb2.StreamConsumeRequest(queue=self.queue, max_batch=20, prefetch=40)
        )

        def requests() -> Iterator[service_pb2.StreamConsumeRequest]:
            while (item := self._requests.get()) is not None:
                yield item

        self._call = self.svc.StreamConsume(requests())
        started = time.monotonic()
        try:
            for frame in self._call:
                ids = [m.id for m in frame.messages]
                if frame.HasField("message"):
                    ids.append(frame.message.id)
                if ids:
                    self._requests.put(service_pb2.StreamConsumeRequest(ack_ids=ids))
                    self.delivered += len(ids)
                if self.delivered >= self.limit or self._halt.is_set():
                    break
                if self.rate is not None:
                    ahead = self.delivered / self.rate - (time.monotonic() - started)
                    if ahead > 0 and self._halt.wait(ahead):
                        break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        finally:
            self._requests.put(None)

    def stop(self) -> None:
        self._halt.set()
        if self._call is not None:
            self._call.cancel()
        self.join(10)


class TrickleProducer(threading.Thread):
    """Keeps enqueueing `per_tick` messages per tenant every `period` seconds until stopped."""

    def __init__(
        self, fila: Fila, queue: str, per_tick: dict[str, tuple[int, int]], period: float = 0.2
    ) -> None:
        super().__init__(daemon=True)
        self.fila = fila
        self.queue = queue
        self.per_tick = per_tick
        self.period = period
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            for tenant, (count, weight) in self.per_tick.items():
                enqueue_many(
                    self.fila, self.queue, count, {"tenant": tenant, "weight": str(weight)}
                )

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def stats(fila: Fila, queue: str) -> admin_pb2.GetStatsResponse:
    return fila.stats(queue)


def fila_cli(addr: str, *args: str) -> str:
    """The real `fila` console script (whatever its internal layout), as an operator runs it."""
    script = Path(sys.executable).with_name("fila")
    argv = [str(script)] if script.exists() else [shutil.which("fila") or "fila"]
    done = subprocess.run(
        [*argv, "--addr", addr, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def screenshot_dir(tmp_path: Path) -> Path:
    if os.environ.get("FILA_UPDATE_SCREENSHOTS") == "1":
        target = REPO / "docs" / "images"
        target.mkdir(parents=True, exist_ok=True)
        return target
    return tmp_path


def mark_page(page: Page) -> None:
    """Tag the loaded document: the tag survives live refresh but not a reload."""
    page.evaluate("window.__filaNoReload = true")


def assert_not_reloaded(page: Page) -> None:
    assert page.evaluate("window.__filaNoReload === true"), "the page was reloaded"


# ----------------------------------------------------------------------------- overview


def test_overview_lists_queues_with_depths_and_refreshes_live(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("alpha")
        fila.create_queue("beta", on_failure=DLQ_HOOK)
        enqueue_many(fila, "alpha", 3, {})
        dead_letter(fila, "beta", 2)
        enqueue_many(fila, "beta", 7, {})
        dash = dashboard_factory(server.addr)

        response = page.goto(dash.url + "/")
        assert response is not None and response.status == 200
        headers = response.headers
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "'unsafe-inline'" not in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["cache-control"] == "no-store"

        alpha = page.locator('tr[data-queue="alpha"]')
        beta = page.locator('tr[data-queue="beta"]')
        expect(alpha.locator("td.depth")).to_have_text("3")
        expect(beta.locator("td.depth")).to_have_text("7")
        expect(beta.locator("td.dlq-depth")).to_have_text("2")
        expect(alpha.locator("td.dlq-depth")).to_have_text("0")
        # A DLQ is shown in its parent's row, not as a queue of its own.
        expect(page.locator('tr[data-queue="beta.dlq"]')).to_have_count(0)
        expect(page.locator("#broker-state")).to_have_text("reachable")
        expect(page.locator("#broker-down")).to_have_count(0)

        # Live refresh: new messages show up without reloading the page.
        mark_page(page)
        enqueue_many(fila, "alpha", 5, {})
        fila.create_queue("gamma")
        expect(alpha.locator("td.depth")).to_have_text("8")
        expect(page.locator('tr[data-queue="gamma"] td.depth')).to_have_text("0")
        # Enqueue rate appears from the sampled counters.
        expect(alpha.locator("td.rate-enqueued")).to_have_text(re.compile(r"^\d+(\.\d)?/s$"))
        assert_not_reloaded(page)


# ----------------------------------------------------------------------------- queue page


def test_queue_page_shows_shares_matching_weights(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page, tmp_path: Path
) -> None:
    """A noisy tenant (huge backlog), a quiet one and a premium one (weight 3), one consumer:
    each key's share of deliveries on the page matches its share of the weights."""
    with connect(server.addr) as fila:
        fila.create_queue("tenants", on_enqueue=TENANT_HOOK, on_failure=DLQ_HOOK)
        fila.create_queue("emails", on_failure=DLQ_HOOK)
        dead_letter(fila, "emails", 3)
        enqueue_many(fila, "emails", 40, {})
        enqueue_many(fila, "tenants", 5000, {"tenant": "noisy", "weight": "1"})
        enqueue_many(fila, "tenants", 1000, {"tenant": "quiet", "weight": "1"})
        enqueue_many(fila, "tenants", 2500, {"tenant": "premium", "weight": "3"})
        dash = dashboard_factory(server.addr)

        page.goto(dash.url + "/queues/tenants")
        expect(page.locator('#keys tr[data-key="noisy"] td.pending')).to_have_text("5000")
        expect(page.locator('#keys tr[data-key="premium"] td.weight')).to_have_text("3")
        expect(page.locator("#queue-on-enqueue")).to_contain_text("msg.headers.tenant")

        # A noisy producer and a quiet one keep going while one consumer drains the
        # queue at 300/s: 4,000 deliveries at 1:1:3 take 800/800/2,400, so every key
        # stays backlogged throughout.
        producer = TrickleProducer(fila, "tenants", {"noisy": (40, 1), "quiet": (2, 1)})
        consumer = AckingConsumer(fila.svc, "tenants", limit=4000, rate=300)
        producer.start()
        consumer.start()
        try:
            page.wait_for_function(
                """() => {
                  const rows = [...document.querySelectorAll('#keys tr[data-key]')];
                  const want = ['noisy', 'premium', 'quiet'];
                  if (rows.map(r => r.dataset.key).join() !== want.join()) return false;
                  let delivered = 0;
                  for (const r of rows) {
                    const d = parseFloat(r.dataset.deliveryShare);
                    const w = parseFloat(r.dataset.weightShare);
                    if (!(Math.abs(d - w) <= 0.03)) return false;
                    delivered += parseInt(r.children[4].textContent, 10);
                  }
                  return delivered >= 600;
                }""",
                timeout=90_000,
            )
            weight_share = page.locator('#keys tr[data-key="premium"] td.weight-share')
            expect(weight_share).to_have_text("60.0%")
            expect(page.locator('#keys tr[data-key="quiet"] td.weight-share')).to_have_text("20.0%")
            # The charts have lines once rates exist.
            expect(page.locator("polyline.s-deliv")).to_have_count(1)
            expect(page.locator("polyline.s-enq")).to_have_count(1)
            assert consumer.error is None, consumer.error
            shots = screenshot_dir(tmp_path)
            page.screenshot(path=str(shots / "dashboard-queue.png"))
            page.goto(dash.url + "/")
            tenants = page.locator('tr[data-queue="tenants"]')
            expect(tenants.locator("td.consumers")).to_have_text("1")
            expect(tenants.locator("td.rate-delivered")).not_to_have_text(
                re.compile(r"^(0\.0/s|—)$")
            )
            bottom = page.evaluate(
                "document.querySelector('footer').getBoundingClientRect().bottom"
            )
            page.screenshot(
                path=str(shots / "dashboard-overview.png"),
                clip={"x": 0, "y": 0, "width": 1360, "height": min(900, bottom + 8)},
            )
        finally:
            consumer.stop()
            producer.stop()


def test_peek_shows_messages_without_changing_depth_or_attempts(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("browse", on_enqueue=TENANT_HOOK)
        for i in range(23):
            tenant = "a" if i % 2 == 0 else "b"  # 12 of a, 11 of b
            fila.enqueue("browse", f"body-{i}".encode(), {"tenant": tenant, "n": str(i)})
        leased = ConsumeStream(fila.svc, "browse", read_limit=1, prefetch=1)
        held = leased.get(10)  # one message in flight, held by a consumer
        before = stats(fila, "browse")
        assert (before.depth, before.in_flight) == (22, 1)
        dash = dashboard_factory(server.addr)

        page.goto(dash.url + "/queues/browse")
        rows = page.locator("#messages tr.message")
        expect(rows).to_have_count(20)
        first = rows.first
        expect(first.locator("td.attempts")).to_have_text("0")
        expect(first.locator("pre.payload")).to_have_text("body-0")
        expect(first.locator("dl.headers")).to_contain_text("tenant")
        held_row = page.locator(f'#messages tr.message[data-id="{held.id}"]')
        expect(held_row.locator("td.leased")).to_contain_text("UTC")
        page.locator("#next-page").click()
        expect(rows).to_have_count(3)
        expect(page.locator("#next-page")).to_have_count(0)

        page.goto(dash.url + "/queues/browse?key=b")
        expect(rows).to_have_count(11)
        expect(page.locator("#messages td.fairness-key")).to_have_text(["b"] * 11)

        # Nothing changed: same depth and lease, and every message is still on its
        # first delivery (a peek that leased would have raised attempt counts).
        after = stats(fila, "browse")
        assert (after.depth, after.in_flight) == (22, 1)
        # (The held message may come back as a failed attempt when its consumer goes
        # away, and is left out: acking it first would let the broker hand that
        # consumer one more message, which would then come back the same way.)
        leased.cancel()
        with ConsumeStream(fila.svc, "browse") as stream:
            delivered = stream.take(22, timeout=30, ack=True)
        attempts = [m.metadata.attempt_count for m in delivered if m.id != held.id]
        assert len(attempts) >= 21 and set(attempts) == {0}, attempts


# ----------------------------------------------------------------------------- DLQ page


def test_dlq_redrive_and_purge_change_the_broker(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("jobs", on_failure=DLQ_HOOK)
        dead_letter(fila, "jobs", 6)
        assert stats(fila, "jobs.dlq").depth == 6
        dash = dashboard_factory(server.addr, extra_args=WRITES_ON_LOOPBACK)

        page.goto(dash.url + "/")
        page.locator('tr[data-queue="jobs"] td.dlq-depth a').click()
        expect(page.locator("#dlq-summary #depth")).to_have_text("6")
        expect(page.locator("#messages tr.message")).to_have_count(6)

        page.locator("#redrive-count").fill("2")
        page.locator("#redrive").click()
        expect(page.locator("#question")).to_contain_text("up to 2")
        assert stats(fila, "jobs.dlq").depth == 6  # asking changes nothing
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_have_text(
            "Redrove 2 message(s) from “jobs.dlq” to “jobs”."
        )
        assert (stats(fila, "jobs.dlq").depth, stats(fila, "jobs").depth) == (4, 2)
        expect(page.locator("#dlq-summary #depth")).to_have_text("4")

        page.locator("#purge").click()
        expect(page.locator("#question")).to_contain_text("cannot be undone")
        page.locator("#cancel").click()
        assert stats(fila, "jobs.dlq").depth == 4

        # The confirmation is enforced by the server, not only offered by the page:
        # a POST with a valid CSRF token but without it changes nothing.
        confirm_page = page.request.get(dash.url + "/dlq/jobs.dlq/confirm/purge").text()
        found = re.search(r'name="csrf_token" value="([0-9a-f]+)"', confirm_page)
        assert found is not None
        token = found.group(1)
        unconfirmed = page.request.post(
            dash.url + "/dlq/jobs.dlq/purge", form={"csrf_token": token}, max_redirects=0
        )
        assert unconfirmed.status == 303
        assert stats(fila, "jobs.dlq").depth == 4

        page.locator("#purge").click()
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_have_text("Purged 4 message(s) from “jobs.dlq”.")
        assert (stats(fila, "jobs.dlq").depth, stats(fila, "jobs").depth) == (0, 2)
        expect(page.locator("#no-messages")).to_be_visible()

        # Redrive of all (count 0), after two more failures.
        with ConsumeStream(fila.svc, "jobs") as stream:
            for message in stream.take(2, timeout=30):
                fila.nack("jobs", message.id, "again")
        page.goto(dash.url + "/dlq/jobs.dlq")
        page.locator("#redrive").click()
        expect(page.locator("#question")).to_contain_text("Move all")
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_contain_text("Redrove 2 message(s)")
        assert (stats(fila, "jobs.dlq").depth, stats(fila, "jobs").depth) == (0, 2)

        # "jobs" is not a DLQ: its DLQ address shows the queue's own page, and no DLQ
        # action runs on it, even confirmed and with a valid token.
        page.goto(dash.url + "/dlq/jobs")
        expect(page).to_have_url(dash.url + "/queues/jobs")
        refused = page.request.get(dash.url + "/dlq/jobs/confirm/purge")
        assert refused.status == 404 and "not a dead-letter queue" in refused.text()
        for action in ("purge", "redrive"):
            refused = page.request.post(
                dash.url + f"/dlq/jobs/{action}",
                form={"csrf_token": token, "confirmed": "yes", "count": "0"},
                max_redirects=0,
            )
            assert refused.status == 404 and "not a dead-letter queue" in refused.text()
        assert stats(fila, "jobs").depth == 2


# ------------------------------------------------------------ failures, schedules, settings


def utc(moment: Timestamp) -> str:
    """A Timestamp as the dashboard writes it."""
    seconds = datetime.fromtimestamp(moment.seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"{seconds}.{moment.nanos // 1_000_000:03d} UTC"


def test_dlq_page_shows_why_and_when_each_message_failed(
    shared_broker: ServerProcess, shared_dash: DashboardProcess, page: Page
) -> None:
    error = "<b>card declined</b> " + "x" * 150 + "\nTraceback (most recent call last):\n  boom"
    with connect(shared_broker.addr) as fila:
        fila.create_queue("payments", on_failure=DLQ_HOOK)
        fila.enqueue("payments", b"charge")
        with ConsumeStream(fila.svc, "payments") as stream:
            fila.nack("payments", stream.get(10).id, error)
        request = admin_pb2.PeekMessagesRequest(queue="payments.dlq")
        [dead] = fila.admin.PeekMessages(request, timeout=10).messages
    assert dead.metadata.last_error == error

    page.goto(shared_dash.url + "/dlq/payments.dlq")
    row = page.locator(f'#messages tr.message[data-id="{dead.id}"]')
    summary = row.locator("td.last-error summary")
    expect(summary).to_have_text(error[:120] + "…")  # clipped: the first line, cut
    full = row.locator("td.last-error pre")
    expect(full).to_be_hidden()
    summary.click()
    expect(full).to_be_visible()
    assert full.inner_text() == error  # all of it, as text
    expect(row.locator("td.failed-at")).to_have_text(utc(dead.metadata.last_failed_at))
    expect(row.locator("td.dead-lettered-at")).to_have_text(utc(dead.metadata.dead_lettered_at))
    expect(page.locator("main b")).to_have_count(0)


def test_scheduled_view_lists_delayed_and_leased_messages(
    shared_broker: ServerProcess, shared_dash: DashboardProcess, page: Page
) -> None:
    with connect(shared_broker.addr) as fila:
        fila.create_queue("reminders", visibility_timeout_ms=600_000)
        fila.enqueue("reminders", b"now")
        holder = ConsumeStream(fila.svc, "reminders", read_limit=1, prefetch=1)
        held = holder.get(10)
        later = [
            service_pb2.EnqueueRequest(queue="reminders", payload=b"later", delay_ms=600_000)
            for _ in range(21)  # one more than a page
        ]
        fila.svc.EnqueueBatch(service_pb2.EnqueueBatchRequest(messages=later), timeout=30)
        fila.enqueue("reminders", b"ready")
        peeked = fila.admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue="reminders", limit=100), timeout=10
        )
    states = {m.id: s for m, s in zip(peeked.messages, peeked.states, strict=True)}
    first_delayed = next(i for i, s in states.items() if s.state == admin_pb2.DELAYED)
    try:
        page.goto(shared_dash.url + "/queues/reminders/scheduled")
        # The counts add up: depth 22 = 1 ready + 21 delayed; in flight = 1 leased.
        for counter, value in (("ready", 1), ("delayed", 21), ("leased", 1), ("depth", 22)):
            expect(page.locator(f"#count-{counter}")).to_have_text(str(value))
        delayed = page.locator("#delayed tr.message")
        expect(delayed).to_have_count(20)
        row = page.locator(f'#delayed tr[data-id="{first_delayed}"]')
        expect(row.locator("td.ready-at")).to_have_text(utc(states[first_delayed].ready_at))
        ten_minutes = re.compile(r"^in (9m[0-5]\ds|10m)$")
        expect(row.locator("td.ready-in")).to_have_text(ten_minutes)
        lease = page.locator(f'#leased tr[data-id="{held.id}"]')
        expect(lease.locator("td.deadline")).to_have_text(utc(states[held.id].lease_deadline))
        expect(lease.locator("td.expires-in")).to_have_text(ten_minutes)
        expect(lease.locator("td.attempt")).to_have_text("1")
        page.locator("#next-delayed_after").click()
        expect(delayed).to_have_count(1)
        expect(page.locator("#leased tr.message")).to_have_count(1)
    finally:
        holder.cancel()


NEW_HOOK = """function on_enqueue(msg)
  if msg.headers.boom then error("kaboom") end
  return { fairness_key = "edited" }
end
"""


def _queue_config(fila: Fila, queue: str) -> admin_pb2.QueueConfig:
    return fila.admin.GetQueue(admin_pb2.GetQueueRequest(queue=queue), timeout=10).config


def test_queue_settings_are_shown_and_edited_through_the_form(
    shared_broker: ServerProcess, shared_dash: DashboardProcess, page: Page
) -> None:
    with connect(shared_broker.addr) as fila:
        fila.create_queue("orders", on_enqueue=TENANT_HOOK, visibility_timeout_ms=20_000)
        page.goto(shared_dash.url + "/queues/orders")
        expect(page.locator("#queue-visibility-timeout")).to_have_text("20s")
        expect(page.locator("#queue-max-attempts")).to_have_text("25")
        assert page.locator("#queue-on-enqueue").inner_text() == TENANT_HOOK
        expect(page.locator("#queue-on-failure")).to_contain_text("None")
        page.locator("#edit-queue").click()
        # Changed with the API while the form is open: saving the form keeps it.
        fila.admin.UpdateQueue(
            admin_pb2.UpdateQueueRequest(
                queue="orders",
                config=admin_pb2.QueueConfig(max_attempts=7),
                update_mask=["max_attempts"],
            ),
            timeout=10,
        )
        page.locator("#edit-visibility_timeout_ms").fill("45s")
        page.locator("#edit-on_enqueue_script").fill(NEW_HOOK)
        page.locator("#edit-save").click()
        expect(page.locator("#flash")).to_have_text(
            "Updated “orders”: visibility timeout, on_enqueue script."
        )
        config = _queue_config(fila, "orders")
        assert (config.visibility_timeout_ms, config.on_enqueue_script) == (45_000, NEW_HOOK)
        assert (config.max_attempts, config.on_failure_script) == (7, "")
        expect(page.locator("#queue-visibility-timeout")).to_have_text("45s")
        expect(page.locator("#queue-max-attempts")).to_have_text("7")
        assert page.locator("#queue-on-enqueue").inner_text() == NEW_HOOK
        # The new hook is in force; its run-time error is counted and shown.
        fila.enqueue("orders", b"x", {"boom": "1"})
        expect(page.locator("#hook-errors")).to_have_text("1")
        expect(page.locator("#last-hook-error")).to_contain_text("kaboom")

        # A script that does not compile: the broker's words, and nothing changes.
        bad = "function on_enqueue(msg) return {"
        try:
            fila.admin.UpdateQueue(
                admin_pb2.UpdateQueueRequest(
                    queue="orders",
                    config=admin_pb2.QueueConfig(on_enqueue_script=bad),
                    update_mask=["on_enqueue_script"],
                ),
                timeout=10,
            )
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            broker_message = err.details()
        else:
            raise AssertionError("the broker accepted a script that does not compile")
        page.locator("#edit-queue").click()
        page.locator("#edit-visibility_timeout_ms").fill("1m")
        page.locator("#edit-on_enqueue_script").fill(bad)
        page.locator("#edit-save").click()
        expect(page.locator("#edit-error")).to_have_text(
            f"The broker refused the change, and nothing was changed: {broker_message}"
        )
        expect(page.locator("#edit-on_enqueue_script")).to_have_value(bad)  # kept as typed
        assert _queue_config(fila, "orders") == config


# ----------------------------------------------------------------------------- config page


def test_config_change_shows_up_in_the_cli(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    dash = dashboard_factory(server.addr, extra_args=WRITES_ON_LOOPBACK)
    page.goto(dash.url + "/config")
    page.locator("#config-key").fill("throttle.acme")
    page.locator("#config-value").fill("20,5")
    page.locator("#config-set").click()
    expect(page.locator("#flash")).to_have_text("Set throttle.acme = 20,5")
    expect(page.locator('tr[data-config-key="throttle.acme"] td.value')).to_have_text("20,5")
    listed = fila_cli(server.addr, "--json", "config", "list")
    assert '"throttle.acme"' in listed and '"20,5"' in listed, listed

    # An invalid value: the broker's validation message is shown, nothing changes.
    with connect(server.addr) as fila:
        try:
            fila.admin.SetConfig(
                admin_pb2.SetConfigRequest(key="throttle.acme", value="fast"), timeout=10
            )
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            broker_message = err.details()
        else:
            raise AssertionError("the broker accepted a bad throttle value")
    page.locator("#config-key").fill("throttle.acme")
    page.locator("#config-value").fill("fast")
    page.locator("#config-set").click()
    expect(page.locator("#config-error")).to_have_text(
        f"The broker refused the change: {broker_message}"
    )
    expect(page.locator("#config-value")).to_have_value("fast")  # what was typed is kept
    assert '"20,5"' in fila_cli(server.addr, "--json", "config", "list")

    page.locator('tr[data-config-key="throttle.acme"] button').click()
    expect(page.locator("#flash")).to_have_text("Deleted throttle.acme")
    assert "throttle.acme" not in fila_cli(server.addr, "--json", "config", "list")


# ----------------------------------------------------------------------------- errors


def test_page_recovers_after_broker_restart(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("steady")
        enqueue_many(fila, "steady", 4, {})
    dash = dashboard_factory(server.addr)
    page.goto(dash.url + "/")
    depth = page.locator('tr[data-queue="steady"] td.depth')
    expect(depth).to_have_text("4")
    mark_page(page)

    server.stop()
    banner = page.locator("#broker-down")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text(f"Broker unreachable at {server.addr}")
    expect(page.locator("#broker-state")).to_have_text("unreachable")

    server.start()
    expect(banner).to_have_count(0)
    expect(page.locator("#broker-state")).to_have_text("reachable")
    with connect(server.addr) as fila:
        enqueue_many(fila, "steady", 1, {})
    expect(depth).to_have_text("5")
    assert_not_reloaded(page)


# ----------------------------------------------------------------------------- security


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_token_is_required_and_enforced_off_loopback(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    token = "s3cret-token-for-the-dashboard"
    refused = dashboard_factory(server.addr, host="0.0.0.0", start=False)
    code, output = refused.run_to_exit()
    assert code != 0
    assert "--auth-token" in output and "not a loopback address" in output

    dash = dashboard_factory(server.addr, host="0.0.0.0", env={"FILA_DASHBOARD_TOKEN": token})
    # Without a session: pages redirect to the login form, fragments and posts are refused.
    page.goto(dash.url + "/config")
    expect(page).to_have_url(re.compile(r"/login\?next=%2Fconfig$"))
    assert _get(dash.url + "/live/overview")[0] == 401
    assert _get(dash.url + "/live/overview", {"Authorization": "Bearer nope"})[0] == 401
    assert _get(dash.url + "/live/overview", {"Cookie": "fila_dashboard_session=x"})[0] == 401
    assert _get(dash.url + "/live/overview", {"Authorization": f"Bearer {token}"})[0] == 200
    assert page.request.post(dash.url + "/config/set", form={"key": "k", "value": "v"}).status in (
        401,
        403,
    )

    page.locator("#token").fill("wrong-token-wrong-token")
    page.locator("#login").click()
    expect(page.locator("#login-error")).to_have_text("Wrong token.")
    page.locator("#token").fill(token)
    page.locator("#login").click()
    expect(page).to_have_url(dash.url + "/config")
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["fila_dashboard_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict"
    assert token not in session["value"]

    page.goto(dash.url + "/")
    expect(page.locator("#broker-state")).to_have_text("reachable")
    page.locator("header form button").click()  # log out
    expect(page).to_have_url(re.compile(r"/login$"))
    page.goto(dash.url + "/")
    expect(page).to_have_url(re.compile(r"/login\?next=%2F$"))


def test_posts_need_the_csrf_token(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page, browser: Browser
) -> None:
    dash = dashboard_factory(server.addr, extra_args=WRITES_ON_LOOPBACK)
    page.goto(dash.url + "/config")
    token = page.locator('#config-form input[name="csrf_token"]').input_value()
    url = dash.url + "/config/set"

    def post(form: dict[str, str], headers: dict[str, str] | None = None) -> int:
        reply = page.request.post(url, form=form, headers=headers, max_redirects=0)
        return reply.status

    assert post({"key": "csrf.none", "value": "1"}) == 403
    assert post({"key": "csrf.bad", "value": "1", "csrf_token": "0" * 64}) == 403
    assert (
        post(
            {"key": "csrf.origin", "value": "1", "csrf_token": token},
            {"Origin": "http://evil.example"},
        )
        == 403
    )
    # A token from another browser (another cookie) does not fit this one's cookie.
    other = browser.new_context()
    try:
        other_page = other.new_page()
        other_page.goto(dash.url + "/config")
        foreign = other_page.locator('#config-form input[name="csrf_token"]').input_value()
        assert foreign != token
        assert post({"key": "csrf.foreign", "value": "1", "csrf_token": foreign}) == 403
    finally:
        other.close()
    with connect(server.addr) as fila:
        assert fila.admin.ListConfig(admin_pb2.ListConfigRequest(), timeout=10).total_count == 0
    assert post({"key": "csrf.ok", "value": "1", "csrf_token": token}) == 303
    assert '"csrf.ok"' in fila_cli(server.addr, "--json", "config", "list")

    # DNS rebinding: on loopback, a foreign Host is refused.
    status, _ = _get(dash.url + "/", {"Host": f"evil.example:{dash.port}"})
    assert status == 421


def test_message_content_renders_as_text(
    server: ServerProcess, dashboard_factory: DashboardFactory, page: Page
) -> None:
    payload = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    key = "<b>tenant</b>"
    with connect(server.addr) as fila:
        fila.create_queue("xss", on_enqueue=TENANT_HOOK)
        fila.enqueue(
            "xss", payload.encode(), {"tenant": key, "note": "<script>window.__pwned=3</script>"}
        )
        fila.admin.SetConfig(
            admin_pb2.SetConfigRequest(key="html.value", value="<img src=x onerror=alert(4)>"),
            timeout=10,
        )
    dash = dashboard_factory(server.addr, extra_args=WRITES_ON_LOOPBACK)

    page.goto(dash.url + "/queues/xss")
    expect(page.locator("#messages pre.payload")).to_have_text(payload)
    expect(page.locator("#messages dl.headers")).to_contain_text(
        "<script>window.__pwned=3</script>"
    )
    expect(page.locator(f'#keys tr[data-key="{key}"] td').first).to_have_text(key)
    mark_page(page)
    expect(page.locator("#live")).to_have_attribute("data-refreshed-at", re.compile(r"\d+"))
    assert_not_reloaded(page)  # the live-refreshed fragment is escaped too
    page.goto(dash.url + "/config")
    expect(page.locator('tr[data-config-key="html.value"] td.value')).to_have_text(
        "<img src=x onerror=alert(4)>"
    )
    page.locator("#config-key").fill("<i>k</i>")
    page.locator("#config-value").fill("<b>v</b>")
    page.locator("#config-set").click()
    expect(page.locator("#flash")).to_have_text("Set <i>k</i> = <b>v</b>")
    assert page.evaluate("window.__pwned") is None
    expect(page.locator("main img, main b, main i")).to_have_count(0)


# ----------------------------------------------------------------------------- API keys

BOOTSTRAP_KEY = "bootstrap-key-for-dashboard-tests"
AUTH_CONFIG = f'[auth]\nbootstrap_apikey = "{BOOTSTRAP_KEY}"\n'


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds `authorization: Bearer KEY` to every call of a test's raw stubs."""

    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@contextlib.contextmanager
def connect_as(addr: str, key: str) -> Iterator[Fila]:
    """`support.stubs.connect`, sending an API key."""
    with grpc.insecure_channel(addr) as channel:
        authed = grpc.intercept_channel(channel, _BearerInterceptor(key))
        yield Fila(
            authed,
            service_pb2_grpc.FilaServiceStub(authed),
            admin_pb2_grpc.FilaAdminStub(authed),
        )


def _authed_admin(addr: str, key: str) -> tuple[grpc.Channel, admin_pb2_grpc.FilaAdminStub, Any]:
    channel = grpc.insecure_channel(addr)
    return channel, admin_pb2_grpc.FilaAdminStub(channel), (("authorization", f"Bearer {key}"),)


def test_dashboard_uses_its_api_key_and_never_shows_it(
    server_factory: ServerFactory, dashboard_factory: DashboardFactory, page: Page
) -> None:
    broker = server_factory(config_toml=AUTH_CONFIG)
    channel, admin, metadata = _authed_admin(broker.addr, BOOTSTRAP_KEY)
    with channel:
        admin.CreateQueue(admin_pb2.CreateQueueRequest(name="secured"), metadata=metadata)

    keyless = dashboard_factory(broker.addr)
    page.goto(keyless.url + "/")
    expect(page.locator("#broker-down")).to_contain_text("missing API key")  # broker's words

    dash = dashboard_factory(broker.addr, env={"FILA_API_KEY": BOOTSTRAP_KEY})
    for path in ("/", "/queues/secured", "/dlq/secured.dlq", "/config", "/apikeys"):
        page.goto(dash.url + path)
        expect(page.locator("#broker-down")).to_have_count(0)
        assert BOOTSTRAP_KEY not in page.content()
    expect(page.locator("main")).to_be_visible()
    page.goto(dash.url + "/")
    expect(page.locator('tr[data-queue="secured"] td.depth')).to_have_text("0")
    assert all(BOOTSTRAP_KEY not in c["value"] for c in page.context.cookies())
    script = page.request.get(dash.url + "/static/dashboard.js").text()
    assert BOOTSTRAP_KEY not in script


class _NoApiKeysAdmin(admin_pb2_grpc.FilaAdminServicer):
    """A broker without the API-key RPCs: the generated base answers UNIMPLEMENTED."""

    def ListQueues(self, request: Any, context: Any) -> admin_pb2.ListQueuesResponse:
        return admin_pb2.ListQueuesResponse(cluster_node_count=1)

    def ListApiKeys(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")


def test_apikeys_page_says_not_available_when_the_broker_lacks_them(
    dashboard_factory: DashboardFactory, page: Page
) -> None:
    """Against a broker that answers UNIMPLEMENTED (a stand-in, so this keeps testing the
    message after the real broker gains API keys)."""
    stand_in = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    admin_pb2_grpc.add_FilaAdminServicer_to_server(_NoApiKeysAdmin(), stand_in)
    port = stand_in.add_insecure_port("127.0.0.1:0")
    stand_in.start()
    try:
        dash = dashboard_factory(f"127.0.0.1:{port}")
        page.goto(dash.url + "/apikeys")
        expect(page.locator("#apikeys-unavailable")).to_have_text(
            "API keys are not available on this broker: it does not implement API keys "
            "(UNIMPLEMENTED)."
        )
        expect(page.locator("#create-key")).to_have_count(0)
        expect(page.locator("#broker-down")).to_have_count(0)
    finally:
        stand_in.stop(None)


def test_apikeys_page_for_a_superadmin(
    server_factory: ServerFactory, dashboard_factory: DashboardFactory, page: Page
) -> None:
    broker = server_factory(config_toml=AUTH_CONFIG)
    dash = dashboard_factory(
        broker.addr, env={"FILA_API_KEY": BOOTSTRAP_KEY}, extra_args=WRITES_ON_LOOPBACK
    )
    channel, admin, metadata = _authed_admin(broker.addr, BOOTSTRAP_KEY)
    with channel:
        admin.ListApiKeys(admin_pb2.ListApiKeysRequest(), metadata=metadata, timeout=10)
        page.goto(dash.url + "/apikeys")
        page.locator("#key-name").fill("reader")
        page.locator("#create").click()
        new_key = page.locator("#new-key").inner_text()
        key_id = page.locator("#new-key-id").inner_text()
        assert new_key and key_id
        page.goto(dash.url + "/apikeys")
        expect(page.locator(f'tr[data-key-id="{key_id}"] td.name')).to_have_text("reader")
        assert new_key not in page.content()  # shown once, never listed

        page.goto(dash.url + f"/apikeys/{key_id}/acl")
        page.locator("#acl-text").fill("fly orders")
        page.locator("#acl-save").click()
        expect(page.locator("#acl-error")).to_contain_text("The broker refused the ACL:")
        page.locator("#acl-text").fill("consume orders\nadmin orders.*")
        page.locator("#acl-save").click()
        expect(page.locator("#flash")).to_have_text(f"ACL of {key_id} saved.")
        acl = admin.GetAcl(admin_pb2.GetAclRequest(key_id=key_id), metadata=metadata, timeout=10)
        assert sorted((p.kind, p.pattern) for p in acl.permissions) == [
            ("admin", "orders.*"),
            ("consume", "orders"),
        ]

        # A dashboard holding that (non-superadmin) key is told why it cannot manage keys.
        limited = dashboard_factory(broker.addr, env={"FILA_API_KEY": new_key})
        page.goto(limited.url + "/apikeys")
        expect(page.locator("#apikeys-unavailable")).to_contain_text(
            "the dashboard's API key may not manage keys"
        )

        page.goto(dash.url + f"/apikeys/{key_id}/confirm-revoke")
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_have_text(f"Revoked key {key_id}.")
        try:
            admin.ListQueues(
                admin_pb2.ListQueuesRequest(),
                metadata=(("authorization", f"Bearer {new_key}"),),
                timeout=10,
            )
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        else:
            raise AssertionError("a revoked key still works")


def test_out_of_range_numbers_in_forms_are_refused_not_a_server_error(
    server_factory: ServerFactory, dashboard_factory: DashboardFactory, page: Page
) -> None:
    broker = server_factory(config_toml=AUTH_CONFIG)
    dash = dashboard_factory(
        broker.addr, env={"FILA_API_KEY": BOOTSTRAP_KEY}, extra_args=WRITES_ON_LOOPBACK
    )
    channel, admin, metadata = _authed_admin(broker.addr, BOOTSTRAP_KEY)
    with channel:
        admin.CreateQueue(admin_pb2.CreateQueueRequest(name="oor"), metadata=metadata, timeout=10)
    page.goto(dash.url + "/apikeys")
    token = page.locator('#create-key input[name="csrf_token"]').input_value()

    def post(path: str, form: dict[str, str]) -> int:
        reply = page.request.post(
            dash.url + path, form={**form, "csrf_token": token}, max_redirects=0
        )
        return reply.status

    for days in ("inf", "nan", "1e300", "-1"):
        assert post("/apikeys/create", {"name": "odd", "expires_days": days}) == 303, days
    huge = str(2**64)
    assert post("/dlq/oor.dlq/redrive", {"count": huge}) == 303
    confirm = page.request.get(dash.url + f"/dlq/oor.dlq/confirm/redrive?count={huge}")
    assert confirm.status < 500


def test_dashboard_honours_the_acl_of_its_key(
    server_factory: ServerFactory, dashboard_factory: DashboardFactory, page: Page
) -> None:
    """A dashboard holding a limited key sees what the key may see, and a refused action
    shows the broker's reason."""
    broker = server_factory(config_toml=AUTH_CONFIG)
    with connect_as(broker.addr, BOOTSTRAP_KEY) as fila:
        created = fila.admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(name="viewer"), timeout=10)
        fila.admin.SetAcl(
            admin_pb2.SetAclRequest(
                key_id=created.key_id,
                permissions=[admin_pb2.AclPermission(kind="consume", pattern="orders")],
            ),
            timeout=10,
        )
        fila.create_queue("orders", on_failure=DLQ_HOOK)
        fila.create_queue("billing")
        dead_letter(fila, "orders", 2)
        enqueue_many(fila, "orders", 3, {})

    with connect_as(broker.addr, created.key) as viewer:
        try:
            viewer.admin.PurgeQueue(admin_pb2.PurgeQueueRequest(queue="orders.dlq"), timeout=10)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            broker_message = err.details()
        else:
            raise AssertionError("a consume-only key purged a queue")

    dash = dashboard_factory(
        broker.addr, env={"FILA_API_KEY": created.key}, extra_args=WRITES_ON_LOOPBACK
    )
    page.goto(dash.url + "/")
    expect(page.locator('tr[data-queue="orders"] td.depth')).to_have_text("3")
    expect(page.locator('tr[data-queue="orders"] td.dlq-depth')).to_have_text("2")
    expect(page.locator('tr[data-queue="billing"]')).to_have_count(0)
    # GetStats needs admin: the row says so instead of showing made-up rates.
    expect(page.locator('tr[data-queue="orders"]')).to_contain_text("(stats refused)")

    page.goto(dash.url + "/dlq/orders.dlq")
    page.locator("#purge").click()
    page.locator("#confirm").click()
    expect(page.locator("#flash")).to_have_text(f"Purge refused by the broker: {broker_message}")
    with connect_as(broker.addr, BOOTSTRAP_KEY) as fila:
        assert stats(fila, "orders.dlq").depth == 2


# ----------------------------------------------------------------------------- read-only

READ_ONLY_REFUSAL = "Refused: this dashboard is read-only"


def _broker_state(fila: Fila, key_id: str) -> tuple[Any, ...]:
    """What a write through the dashboard could change: keys, an ACL, config, depths."""
    keys = fila.admin.ListApiKeys(admin_pb2.ListApiKeysRequest(), timeout=10).keys
    acl = fila.admin.GetAcl(admin_pb2.GetAclRequest(key_id=key_id), timeout=10)
    config = fila.admin.ListConfig(admin_pb2.ListConfigRequest(), timeout=10).entries
    return (
        sorted((k.key_id, k.name, k.is_superadmin) for k in keys),
        sorted((p.kind, p.pattern) for p in acl.permissions),
        sorted((e.key, e.value) for e in config),
        stats(fila, "jobs").depth,
        stats(fila, "jobs.dlq").depth,
        _queue_config(fila, "jobs"),
    )


def test_without_a_token_the_dashboard_is_read_only(
    server_factory: ServerFactory, dashboard_factory: DashboardFactory, page: Page
) -> None:
    """On loopback without `--auth-token`, any local process acted with the dashboard's
    key (here the bootstrap superadmin's): it read a CSRF token from a page and minted
    itself a superadmin key. Now every change is refused by the server, with a valid
    CSRF token too, every page says so, and the broker is left as it was."""
    broker = server_factory(config_toml=AUTH_CONFIG)
    with connect_as(broker.addr, BOOTSTRAP_KEY) as fila:
        try:
            victim = fila.admin.CreateApiKey(
                admin_pb2.CreateApiKeyRequest(name="victim"), timeout=10
            )
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            pytest.skip("this broker answers UNIMPLEMENTED to CreateApiKey (API keys not built)")
        fila.admin.SetAcl(
            admin_pb2.SetAclRequest(
                key_id=victim.key_id,
                permissions=[admin_pb2.AclPermission(kind="consume", pattern="jobs")],
            ),
            timeout=10,
        )
        fila.create_queue("jobs", on_failure=DLQ_HOOK)
        dead_letter(fila, "jobs", 3)
        fila.admin.SetConfig(admin_pb2.SetConfigRequest(key="keep.me", value="1"), timeout=10)
        before = _broker_state(fila, victim.key_id)

    dash = dashboard_factory(broker.addr, env={"FILA_API_KEY": BOOTSTRAP_KEY})
    pages = (
        "/",
        "/queues/jobs",
        "/dlq/jobs.dlq",
        "/config",
        "/apikeys",
        f"/apikeys/{victim.key_id}/acl",
        "/queues/no-such-queue",
    )
    for path in pages:
        page.goto(dash.url + path)
        banner = page.locator("#read-only")
        expect(banner).to_contain_text("changes nothing on the broker")
        expect(banner).to_contain_text("--auth-token TOKEN")
        expect(banner).to_contain_text("--allow-writes-on-loopback")
    for path, button in (
        ("/apikeys", "#create"),
        ("/config", "#config-set"),
        ("/dlq/jobs.dlq", "#purge"),
        ("/dlq/jobs.dlq", "#redrive"),
        (f"/apikeys/{victim.key_id}/acl", "#acl-save"),
    ):
        page.goto(dash.url + path)
        expect(page.locator(button)).to_be_disabled()
    page.goto(dash.url + "/queues/jobs")
    expect(page.locator("#edit-queue")).to_have_text("Edit settings…")
    expect(page.locator("a#edit-queue")).to_have_count(0)  # shown, not a link

    # What a local process does: read a valid CSRF token from a page, then post.
    page.goto(dash.url + "/apikeys")
    token = page.locator('#create-key input[name="csrf_token"]').input_value()
    writes = {
        "/apikeys/create": {"name": "mine", "superadmin": "yes"},
        f"/apikeys/{victim.key_id}/revoke": {"confirmed": "yes"},
        f"/apikeys/{victim.key_id}/acl": {"permissions": "admin *"},
        "/config/set": {"key": "mine", "value": "1"},
        "/config/delete": {"key": "keep.me"},
        "/dlq/jobs.dlq/redrive": {"confirmed": "yes", "count": "0"},
        "/dlq/jobs.dlq/purge": {"confirmed": "yes"},
        "/queues/jobs/edit": {"visibility_timeout_ms": "1s", "on_enqueue_script": ""},
    }
    for path, form in writes.items():
        reply = page.request.post(
            dash.url + path, form={**form, "csrf_token": token}, max_redirects=0
        )
        assert reply.status == 403, path
        assert READ_ONLY_REFUSAL in reply.text(), path
        assert "--auth-token TOKEN" in reply.text()
    # The confirmation pages, the first step of a change, say so too.
    for path in (
        "/dlq/jobs.dlq/confirm/purge",
        "/dlq/jobs.dlq/confirm/redrive?count=0",
        f"/apikeys/{victim.key_id}/confirm-revoke",
        "/queues/jobs/edit",
    ):
        reply = page.request.get(dash.url + path)
        assert reply.status == 403 and READ_ONLY_REFUSAL in reply.text(), path
    with connect_as(broker.addr, BOOTSTRAP_KEY) as fila:
        assert _broker_state(fila, victim.key_id) == before

    # With a token (on loopback too), whoever holds it can change things.
    secret = "a-token-for-the-writable-dashboard"
    writable = dashboard_factory(
        broker.addr, env={"FILA_API_KEY": BOOTSTRAP_KEY, "FILA_DASHBOARD_TOKEN": secret}
    )
    page.goto(writable.url + "/apikeys")
    page.locator("#token").fill(secret)
    page.locator("#login").click()
    expect(page).to_have_url(writable.url + "/apikeys")
    expect(page.locator("#read-only")).to_have_count(0)
    page.locator("#key-name").fill("made-with-the-token")
    page.locator("#create").click()
    key_id = page.locator("#new-key-id").inner_text()
    with connect_as(broker.addr, BOOTSTRAP_KEY) as fila:
        keys = fila.admin.ListApiKeys(admin_pb2.ListApiKeysRequest(), timeout=10).keys
        assert (key_id, "made-with-the-token") in [(k.key_id, k.name) for k in keys]
