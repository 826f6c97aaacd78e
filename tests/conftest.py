"""Shared fixtures: real `fila-server` child processes on temporary data directories.

Tests talk to the broker over real gRPC (raw `fila.v1` stubs or `fila_sdk`), so what
passes here is what a deployed broker does.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ServerFactory

from fila.server.process import ServerProcess

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
