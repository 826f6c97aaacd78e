"""Arguments that may name a file: `@FILE` for scripts and payloads, `-` for stdin."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fila.cli.errors import Failure


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise Failure(f'cannot read {what} "{path}": {err.strerror or err}') from err


def optional_file(path: str | None, what: str) -> bytes | None:
    return None if path is None else read_file(path, what)


def text_or_file(value: str | None, what: str) -> str | None:
    """`@path` names a UTF-8 file holding the text; anything else is the text itself."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return read_file(value[1:], what).decode()
    except UnicodeDecodeError as err:
        raise Failure(f'{what} "{value[1:]}" is not UTF-8 text') from err


def bytes_from(value: str, what: str) -> bytes:
    """`-` reads stdin to its end, `@path` reads a file, anything else is the bytes of
    the argument itself (as the shell passed them, even when not UTF-8)."""
    if value == "-":
        return sys.stdin.buffer.read()
    if value.startswith("@"):
        return read_file(value[1:], what)
    return os.fsencode(value)
