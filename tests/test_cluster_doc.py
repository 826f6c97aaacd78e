"""docs/cluster.md, run as a reader would follow it: three etcd members and three
nodes on one machine, replicated queues, a leader's kill -9, a dead node replaced.

Every fenced ```sh block runs in one bash session (`set -euo pipefail`), in document
order, with the project's virtualenv first on PATH. Lines run verbatim, with two
exceptions, which are the test's own job:
- `source .venv/bin/activate` is skipped (the virtualenv is already on PATH);
- `export DEMO=...` points at a fresh directory of the test's instead.
The session runs in a network namespace of its own (a loopback nobody else uses), so
the fixed ports the page names cannot collide with anything else on the machine.
A plain block marked `<!-- doc-test: output -->` lists lines the runnable block
before it must print (tests/support/markdown.py).

Marked `cluster` (etcd, four nodes, three lease expiries: about a minute).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
from support.cluster import Netns, require_etcd, require_netns
from support.markdown import Block, blocks

pytestmark = pytest.mark.cluster

REPO: Final = Path(__file__).resolve().parent.parent
PAGE: Final = REPO / "docs" / "cluster.md"
SCRIPT_TIMEOUT_S: Final = 300.0

_ACTIVATE: Final = re.compile(r"^(source|\.)\s+\.venv/bin/activate\b")
_DEMO: Final = re.compile(r"^export\s+DEMO=\S+\s*$")


def shell_line(line: str) -> str:
    """The line as the session runs it (see the module docstring)."""
    code = line.strip()
    if _ACTIVATE.match(code):
        return f": doc-test skipped: {code!r}"
    if _DEMO.match(code):
        return 'export DEMO="$DOC_TMP/demo"'
    return line


def session(markdown: str) -> tuple[str, dict[int, Block]]:
    """The bash script for `markdown`, and the expected outputs by runnable block."""
    script = ["set -euo pipefail"]
    expected: dict[int, Block] = {}
    listed = blocks(markdown)
    for index, block in enumerate(listed):
        if block.marker == "skip" or block.lang != "sh":
            continue
        script.append(f"echo '>>> docs/cluster.md line {block.line}' >&2")
        body = "\n".join(shell_line(line) for line in block.text.splitlines())
        following = next((b for b in listed[index + 1 :] if b.lang or b.marker), None)
        if following is not None and following.marker == "output":
            out = f'"$DOC_TMP/out-{block.line}.txt"'
            body = f"{{\n{body}\n}} >{out}\ncat {out}"
            expected[block.line] = following
        script.append(body)
    return "\n".join(script) + "\n", expected


def _kill_everything_in(namespace: str) -> None:
    listed = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    )
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def test_the_cluster_pages_commands_run_as_written(tmp_path: Path) -> None:
    require_etcd()
    require_netns()
    script, expected = session(PAGE.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FILA_", "GRPC_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    env["DOC_TMP"] = str(tmp_path)
    nets = Netns()
    namespace = nets.namespace("d")
    try:
        run = subprocess.run(
            [*nets.wrapper(namespace), "bash", "-c", script],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
    finally:
        _kill_everything_in(namespace)
        nets.close()
    print(run.stdout)  # shown when the test fails: what the page's commands printed
    print(run.stderr)
    assert run.returncode == 0, (
        f"a docs/cluster.md command failed (the last '>>>' line names its block)\n"
        f"--- stderr ---\n{run.stderr[-6000:]}\n--- stdout ---\n{run.stdout[-6000:]}"
    )
    runnable = [b for b in blocks(PAGE.read_text()) if b.lang == "sh" and b.marker != "skip"]
    assert run.stderr.count(">>> docs/cluster.md line ") == len(runnable), run.stderr
    assert expected, "the page shows the demo's output; its markers are missing"
    for line, block in expected.items():
        printed = (tmp_path / f"out-{line}.txt").read_text()
        for wanted in filter(str.strip, block.text.splitlines()):
            assert wanted in printed, f"docs/cluster.md line {block.line}: {wanted!r} not printed"


def test_session_rules() -> None:
    assert shell_line("source .venv/bin/activate").startswith(": doc-test skipped")
    assert shell_line("export DEMO=/tmp/fila-cluster-demo") == 'export DEMO="$DOC_TMP/demo"'
    assert shell_line("kill $(cat $DEMO/node*.pid)") == "kill $(cat $DEMO/node*.pid)"
