"""Shared fixtures: real `fila-server` child processes on temporary data directories.

Tests talk to the broker over real gRPC (raw `fila.v1` stubs or `fila_sdk`), so what
passes here is what a deployed broker does.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from support import ServerFactory

from fila.testing.server import ServerProcess

# The CLI tests press Ctrl-C (SIGINT) as a terminal does. A suite started in the
# background by a non-interactive shell (`./scripts/test.sh &`) inherits SIGINT
# ignored, and an ignored signal stays ignored across exec: those children would never
# see it and the tests would hang. A handler, unlike SIG_IGN, is reset by exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Fixtures that start fila-server processes; a test using one is marked `process`, so
# `-m "not process"` keeps only what runs in this process (scripts/mutation.sh).
PROCESS_FIXTURES = frozenset({"server", "server_factory"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)


# Under CI=true (.ci/run, the GitHub workflow) a skip is a failure: CI installs every
# tool and runs with the privileges the tests need, so a test that would skip for a
# missing tool or privilege means CI is not testing what it claims, and a green run
# must mean every test ran. Node ids listed here may still skip there (none today).
CI_MAY_SKIP: frozenset[str] = frozenset()


def _failed_in_ci(report: pytest.CollectReport | pytest.TestReport, nodeid: str) -> None:
    if os.environ.get("CI") != "true" or not report.skipped or nodeid in CI_MAY_SKIP:
        return
    if getattr(report, "wasxfail", None) is not None:
        return  # an expected failure, not a skip
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where every test must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    _failed_in_ci(outcome.get_result(), item.nodeid)  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, None]:
    outcome = yield
    _failed_in_ci(outcome.get_result(), collector.nodeid)  # type: ignore[attr-defined]


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """`make(config_toml=, env=, persist_mode=, start=True, wrapper=)` -> ServerProcess.

    Each call gets its own directory under `tmp_path` (config, log and `data/`);
    everything made is stopped at teardown, even if a test killed or restarted it.
    """
    made: list[ServerProcess] = []

    def make(
        *,
        config_toml: str | None = None,
        env: dict[str, str] | None = None,
        persist_mode: str | None = None,
        start: bool = True,
        timeout: float = 20.0,
        wrapper: list[str] | None = None,
    ) -> ServerProcess:
        root = tmp_path / f"server{len(made)}"
        root.mkdir()
        proc = ServerProcess(
            root / "data",
            config_toml=config_toml,
            env=env,
            persist_mode=persist_mode,
            wrapper=wrapper,
        )
        made.append(proc)
        return proc.start(timeout) if start else proc

    yield make
    errors: list[BaseException] = []
    for proc in made:
        try:
            if proc.running:
                proc.stop()
        except (TimeoutError, OSError) as exc:  # keep stopping the others first
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProcess:
    """A broker with the default configuration, started and SERVING."""
    return server_factory()
