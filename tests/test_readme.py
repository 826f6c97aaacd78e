"""The README, run as a reader would follow it, so its commands and snippets cannot rot.

Every fenced ```sh block runs in one bash session (`set -euo pipefail`), in document
order, so variables and functions carry from block to block as in a reader's
terminal; every ```python block runs in that order too, with the test's interpreter;
every ```lua block must load as a queue's hooks. The session runs in a fresh copy of
the repository (its tracked and unignored files, as a clone has them), with the
project's virtualenv first on PATH and `FILA_ADDR` pointing at a broker this test
started on a free port.

Lines are run verbatim, with three exceptions, which are the test's own job:
- lines that set up the virtualenv (`source .venv/bin/activate`, `scripts/setup.sh`)
  or run this suite (`scripts/test.sh`, which would run this test again) are skipped;
- a line that starts the broker (`./scripts/serve.sh ARGS` or `fila-server ARGS`,
  in the background or not) starts `fila-server ARGS` in the background on a free
  port and a fresh data directory, and points `FILA_ADDR` at it for what follows;
- a line that points `FILA_ADDR` at the port a README broker listens on
  (`export FILA_ADDR=...`) is skipped: the test already pointed it at that broker.
In Python blocks the address "localhost:5555" reads `FILA_ADDR` instead.

Markers, HTML comments on the line before a block (invisible to readers):
- `<!-- readme-test: skip ... -->`: the block is not run (say why in the comment);
- `<!-- readme-test: output -->` before a plain block: every line of it must appear
  in what the preceding runnable block printed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
from support.markdown import Block, blocks

from fila.testing.server import ServerProcess
from fila_sdk import Client

REPO: Final = Path(__file__).resolve().parent.parent
README: Final = REPO / "README.md"
SCRIPT_TIMEOUT_S: Final = 300.0

_VENV_OR_SUITE: Final = re.compile(
    r"^(source|\.)\s+\.venv/bin/activate\b|^(\./)?scripts/(setup|test)\.sh\b"
)
_BROKER: Final = re.compile(
    r"^(?:exec\s+)?(?:(?:\./)?scripts/serve\.sh|(?:\.venv/bin/)?fila-server)"
    r"(?P<args>(?:\s+[^&#]*?)?)\s*&?\s*(?:#.*)?$"
)
_ADDR_EXPORT: Final = re.compile(r"^export\s+FILA_ADDR=\S+\s*(?:#.*)?$")
_ONE_SHOT_FLAGS: Final = re.compile(r"--(check-config|print-default-config|version|help|repair)\b")
_DEFAULT_ADDR: Final = re.compile(r"""(["'])localhost:5555\1""")

PRELUDE: Final = r"""
set -euo pipefail
readme_broker() {
  # A README line that starts the broker: the same command, on a free port and a
  # fresh data directory; what follows talks to it through FILA_ADDR.
  local port deadline
  port=$("$README_PYTHON" -c 'from fila.testing.children import free_port; print(free_port())')
  FILA_LISTEN_ADDR="127.0.0.1:$port" FILA_DATA_DIR="$README_TMP/data-$port" \
    "$@" >>"$README_TMP/brokers.log" 2>&1 &
  echo "$!" >>"$README_TMP/pids"
  export FILA_ADDR="127.0.0.1:$port"
  deadline=$((SECONDS + 30))
  until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      echo "readme-test: the broker did not listen on $port within 30s" >&2
      tail -n 20 "$README_TMP/brokers.log" >&2
      return 1
    fi
    sleep 0.05
  done
}
"""


def shell_line(line: str) -> str:
    """The line as the session runs it (see the module docstring)."""
    code = line.strip()
    if _VENV_OR_SUITE.match(code) or _ADDR_EXPORT.match(code):
        return f": readme-test skipped: {code!r}"
    broker = _BROKER.match(code)
    if broker and not _ONE_SHOT_FLAGS.search(broker["args"]):
        return f"readme_broker fila-server {broker['args'].strip()}".rstrip()
    return line


def session(markdown: str) -> tuple[str, dict[int, Block]]:
    """The bash script for `markdown`, and the expected outputs by runnable block."""
    script = [PRELUDE]
    expected: dict[int, Block] = {}
    listed = blocks(markdown)
    for index, block in enumerate(listed):
        if block.marker == "skip" or block.lang not in ("sh", "python"):
            continue
        script.append(f"echo '>>> README.md line {block.line} ({block.lang})' >&2")
        if block.lang == "sh":
            body = "\n".join(shell_line(line) for line in block.text.splitlines())
        else:
            code = _DEFAULT_ADDR.sub('__import__("os").environ["FILA_ADDR"]', block.text)
            once = f"\"$README_PYTHON\" - <<'README_PYTHON_BLOCK'\n{code}README_PYTHON_BLOCK"
            body = f"{once}\n{once}"
        following = next((b for b in listed[index + 1 :] if b.lang or b.marker), None)
        if following is not None and following.marker == "output":
            out = f'"$README_TMP/out-{block.line}.txt"'
            body = f"{{\n{body}\n}} >{out}\ncat {out}"
            expected[block.line] = following
        script.append(body)
    return "\n".join(script) + "\n", expected


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked and unignored files, as a clone would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip("the repository's file list needs git")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def _stop_brokers(pids_file: Path) -> None:
    if not pids_file.exists():
        return
    for pid in pids_file.read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)


def test_readme_commands_and_snippets_run(server: ServerProcess, tmp_path: Path) -> None:
    script, expected = session(README.read_text())
    clone = fresh_copy(tmp_path / "clone")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FILA_", "GRPC_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        FILA_ADDR=server.addr,
        README_TMP=str(work),
        README_PYTHON=sys.executable,
    )
    try:
        run = subprocess.run(
            ["bash", "-c", script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
    finally:
        _stop_brokers(work / "pids")
    assert run.returncode == 0, (
        f"a README command failed (the last '>>>' line names its block)\n"
        f"--- stderr ---\n{run.stderr[-4000:]}\n--- stdout ---\n{run.stdout[-4000:]}"
    )
    runnable = [b for b in blocks(README.read_text()) if b.lang in ("sh", "python")]
    ran = run.stderr.count(">>> README.md line ")
    assert ran == len([b for b in runnable if b.marker != "skip"]), run.stderr
    assert expected, "the README shows the demo's output; its marker is missing"
    for line, block in expected.items():
        printed = (work / f"out-{line}.txt").read_text()
        for wanted in filter(str.strip, block.text.splitlines()):
            assert wanted in printed, f"README.md line {block.line}: {wanted!r} not printed"


def test_readme_lua_blocks_load_as_hooks(server: ServerProcess) -> None:
    lua = [b for b in blocks(README.read_text()) if b.lang == "lua" and b.marker != "skip"]
    assert lua, "the README's Lua example is gone"
    with Client(server.addr) as client:
        for block in lua:
            client.create_queue(
                f"readme-lua-{block.line}",
                on_enqueue=block.text if "function on_enqueue" in block.text else None,
                on_failure=block.text if "function on_failure" in block.text else None,
            )


def test_session_rules() -> None:
    """The line rules themselves, so a README change cannot slip past them."""
    assert shell_line("source .venv/bin/activate").startswith(": readme-test skipped")
    assert shell_line("./scripts/test.sh     # run the suite").startswith(": readme-test")
    assert shell_line("./scripts/serve.sh    # run it") == "readme_broker fila-server"
    assert shell_line("fila-server --config fila.toml &") == (
        "readme_broker fila-server --config fila.toml"
    )
    assert shell_line("fila-server --check-config --config x.toml") == (
        "fila-server --check-config --config x.toml"
    )
    assert shell_line("fila queue list --json") == "fila queue list --json"
    assert shell_line("export FILA_ADDR=localhost:5556").startswith(": readme-test skipped")
    assert shell_line("export FILA_ADDR_X=1") == "export FILA_ADDR_X=1"
    skipped = "<!-- readme-test: skip (why) -->\n```sh\nfalse\n```\n"
    assert blocks(skipped) == [Block("sh", "false\n", 2, "skip")]
    assert session(skipped)[0] == PRELUDE + "\n"
