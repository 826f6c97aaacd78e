"""The layering contracts in pyproject.toml ([tool.importlinter]) hold, and each can fail.

The first test runs `lint-imports` over the repository as it is. The second copies the
packages, adds one crossing import per contract (MUTATIONS) and checks that the contract
then breaks, so a contract that checks nothing (a misspelt module, a wildcard that
matches nothing, a loosened option) fails here; a contract added without a mutation
fails too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parent.parent
LINT_IMPORTS: Final = Path(sys.executable).parent / "lint-imports"
PACKAGES: Final = ("fila", "fila_sdk", "fila_bench")

# contract id -> (file, a line appended to it that crosses the contract's boundary)
MUTATIONS: Final = {
    "layers": ("fila/storage/keys.py", "import fila.core.errors"),
    "core-no-grpc": ("fila/core/errors.py", "import grpc"),
    "sdk-is-a-client": ("fila_sdk/errors.py", "import fila.storage.keys"),
    "testing-harness-only": ("fila/wire.py", "import fila.testing.children"),
    "core-acyclic": ("fila/core/errors.py", "import fila.core.broker"),
}


def _contract_ids() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return {contract["id"] for contract in config["tool"]["importlinter"]["contracts"]}


def _lint(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` with the repository's contracts over the packages under `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", *args, str(REPO / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_imports_keep_every_layering_contract() -> None:
    result = _lint(REPO, "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_contract_has_a_mutation() -> None:
    assert set(MUTATIONS) == _contract_ids()


@pytest.mark.parametrize("contract", sorted(MUTATIONS))
def test_a_crossing_import_breaks_its_contract(contract: str, tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    module, line = MUTATIONS[contract]
    with (tmp_path / module).open("a", encoding="utf-8") as file:
        file.write(f"\n{line}\n")
    result = _lint(tmp_path, "--no-cache", "--contract", contract)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout, result.stdout + result.stderr
