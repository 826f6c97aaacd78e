"""What a benchmark is to the runner: a name, the results it promises, and a coroutine.

Cases are small and many (one per mode, producer count or key count) so that
`--only` can pick exactly one, a failed check names exactly what failed, and each
case can start its own broker with a clean state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from fila_bench.cpus import Placement
from fila_bench.profile import Profile
from fila_bench.results import Result


@dataclass(frozen=True, slots=True)
class Context:
    profile: Profile
    workdir: Path  # each case's brokers get a fresh directory under it
    status: Callable[[str], None]  # shows what the running case is doing right now
    placement: Placement | None = None  # CPUs for brokers and for this process, if pinned


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    outputs: tuple[str, ...]  # result names, in the order the case returns them
    run: Callable[[Context], Awaitable[list[Result]]]
    # Outputs that are closed-loop rates: the runner also reports each as a ratio to
    # `echo_ceiling_50c` measured in the same run (`<name>_ratio`).
    ratios: tuple[str, ...] = ()
    # Outputs a successful run may lack (best-effort figures); every other output
    # missing from a run that raised nothing is a failure of the benchmark.
    optional: tuple[str, ...] = ()

    @property
    def all_outputs(self) -> tuple[str, ...]:
        return self.outputs + tuple(ratio_name(n) for n in self.ratios)

    def matches(self, pattern: str) -> bool:
        """`--only` accepts a case name or a result name, with shell wildcards."""
        return fnmatchcase(self.name, pattern) or any(
            fnmatchcase(o, pattern) for o in self.all_outputs
        )


def ratio_name(name: str) -> str:
    return f"{name}_ratio"
