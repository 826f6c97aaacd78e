"""The published client SDK (`fila-python` 0.2.0 from PyPI) works against this broker unchanged.

SPEC section 1 makes the `fila.v1` wire API a compatibility contract for the
published SDKs. This test installs the real published package into a private
directory and drives a full lifecycle with it in a subprocess. The published
package's top-level module is also called `fila`, so it cannot share an
interpreter with this repository's broker package; the subprocess puts the
private directory first on its path.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fila.testing.server import ServerProcess

PUBLISHED = "fila-python==0.2.0"

SCRIPT = textwrap.dedent(
    """
    import sys
    import fila
    assert fila.__file__.startswith(sys.argv[2]), fila.__file__  # the published package
    from fila import Client
    from fila.errors import MessageNotFoundError, QueueNotFoundError

    addr = sys.argv[1]
    with Client(addr) as client:
        first = client.enqueue("compat", {"tenant": "acme"}, b"hello")
        second = client.enqueue("compat", None, b"world")
        stream = client.consume("compat")
        got = next(stream)
        assert (got.id, got.payload, got.headers) == (first, b"hello", {"tenant": "acme"}), got
        assert (got.queue, got.attempt_count, got.fairness_key) == ("compat", 0, "default"), got
        client.ack("compat", got.id)
        got = next(stream)
        assert got.id == second, got
        client.nack("compat", got.id, "try again")
        again = next(stream)
        assert (again.id, again.attempt_count) == (second, 1), again
        client.ack("compat", again.id)
        try:
            client.ack("compat", again.id)
        except MessageNotFoundError:
            pass
        else:
            raise AssertionError("second ack of the same id must fail")
        try:
            client.enqueue("no-such-queue", None, b"x")
        except QueueNotFoundError:
            pass
        else:
            raise AssertionError("enqueue to a missing queue must fail")
    print("published-sdk-ok")
    """
)


@pytest.fixture(scope="session")
def published_sdk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("published-sdk")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            PUBLISHED,
        ],
        check=True,
        timeout=120,
    )
    return target


def test_published_python_sdk_full_lifecycle(server: ServerProcess, published_sdk: Path) -> None:
    from fila_sdk import Client

    with Client(server.addr) as admin:
        admin.create_queue("compat")
    result = subprocess.run(
        [sys.executable, "-P", "-c", SCRIPT, server.addr, str(published_sdk)],
        env={"PYTHONPATH": str(published_sdk), "PATH": "/usr/bin:/bin"},
        cwd=published_sdk,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "published-sdk-ok" in result.stdout
