"""The fenced blocks of a Markdown page, for the tests that run a page's commands as a
reader would (tests/test_readme.py for the README, tests/test_cluster_doc.py for
docs/cluster.md).

A block's marker is an HTML comment on the line before it, invisible to readers:
`<!-- readme-test: skip (why) -->` or `<!-- doc-test: output -->` (either prefix):
`skip` leaves the block out; `output` before a plain block means every line of it
must appear in what the preceding runnable block printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_FENCE: Final = re.compile(r"^```(\w*)\s*$")
_MARKER: Final = re.compile(r"<!--\s*(?:readme|doc)-test:\s*([\w-]+)")


@dataclass(frozen=True, slots=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    marker: str | None


def blocks(markdown: str) -> list[Block]:
    found: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.search(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        text = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(opening[1], text, i + 1, marker[1] if marker else None))
        i = end + 1
    return found
