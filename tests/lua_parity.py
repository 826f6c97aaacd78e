"""Harness for comparing the sandbox's string functions with Lua's own C functions.

`Parity(limit)` loads patterns.lua and strings.lua into a bare Lua state (no sandbox,
no budget) with `limit` as the most work a C pattern call may do: 0 sends every call
to the Lua matcher, a small limit mixes C and Lua steps, the default keeps C where
the bound allows. `compare(op, s, p, extra)` runs the original C function and the
replacement on the same arguments and returns None if they agree (same results, or
errors with the same message apart from the line that raised), else a description.
"""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path
from typing import Any

from lupa import lua54

_COMPARE = Path(__file__).with_name("lua_parity.lua").read_bytes()

SUBJECT_BYTES = b"aab:()[]%x \x00A1-"
PATTERN_ATOMS = [
    b"a", b"b", b".", b"%a", b"%d", b"%s", b"%w", b"%A", b"[ab]", b"[^a]", b"[%a-]", b"[]]",
    b"(", b")", b"()", b"%b()", b"%f[a]", b"%f[%W]", b"%1", b"%2", b"$", b"^", b":", b"%",
    b"[", b"\x00", b"-", b"x",
]  # fmt: skip
SUFFIXES = [b"", b"", b"", b"*", b"+", b"-", b"?"]
REPLACEMENTS: list[Any] = [b"<%0>", b"%1-%1", b"%%", b"%2", b"x%", b"%z", b"", 1, 2, 42]


def _source(name: str) -> bytes:
    return resources.files("fila.lua").joinpath(f"{name}.lua").read_bytes()


class Parity:
    def __init__(self, limit: float | None) -> None:
        runtime = lua54.LuaRuntime(encoding=None, unpack_returned_tuples=True)
        self._compare = runtime.execute(
            _COMPARE,
            runtime.compile(_source("patterns"), name=b"=fila.patterns"),
            runtime.compile(_source("strings"), name=b"=fila.strings"),
            limit,
        )

    def compare(self, op: str, s: bytes, p: bytes, init: int | None, *extra: Any) -> str | None:
        why = self._compare(op.encode(), s, p, init, *extra)
        return None if why is None else why.decode("utf-8", "replace")


def random_case(rnd: random.Random) -> tuple[str, bytes, bytes, int | None, Any, int | None]:
    op = rnd.choice(["find", "match", "gmatch", "gsub", "plain"])
    s = bytes(rnd.choice(SUBJECT_BYTES) for _ in range(rnd.randint(0, 14)))
    if rnd.random() < 0.2:
        s = b"a" * rnd.randint(0, 40) + s
    atoms = []
    for _ in range(rnd.randint(0, 5)):
        atom = rnd.choice(PATTERN_ATOMS)
        atoms.append(atom + (rnd.choice(SUFFIXES) if rnd.random() < 0.5 else b""))
    p = b"".join(atoms)
    init = rnd.choice([None, None, 1, 2, 0, -1, -4, 7, 40])
    repl = rnd.choice(REPLACEMENTS)
    n = rnd.choice([None, None, 0, 1, 2])
    return op, s, p, init, repl, n
