"""A creation-time check of a hook script: refuse one that calls what the sandbox lacks.

The sandbox has no `os`, `io`, `require`, `load`, `debug` or `string.dump`. A script
that calls `os.execute` compiles and loads fine (the call runs only when the hook
does), and then fails for every message at run time, visible only as a log line and
a counter. This check reads the script's tokens and refuses it at CreateQueue or
UpdateQueue, naming the first such use.

What counts: a global name used as a function or a table (followed by `(`, `.`, `:`,
`[`, a string or a table constructor), or a member of a sandbox table (`string.dump`),
that the sandbox does not provide and the script never defines. A name the script
declares local anywhere, or assigns as a global anywhere, is taken as defined: the
check ignores scope and control flow, so it can miss a use but never refuses a script
that defines what it uses. Calling an undefined global always raises when reached,
so refusing it costs nothing a working script needs. Recovery does not run this
check: a stored queue's hooks load as they did.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Final

from fila.lua.sandbox import ScriptError

_KEYWORDS: Final = frozenset(
    [
        "and",
        "break",
        "do",
        "else",
        "elseif",
        "end",
        "false",
        "for",
        "function",
        "goto",
        "if",
        "in",
        "local",
        "nil",
        "not",
        "or",
        "repeat",
        "return",
        "then",
        "true",
        "until",
        "while",
    ]
)
_LONG_OPEN: Final = re.compile(r"\[(=*)\[")
_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER: Final = re.compile(
    r"0[xX](?:[0-9a-fA-F]*\.?[0-9a-fA-F]*)(?:[pP][+-]?\d+)?|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
)
_SYMBOLS: Final = ("...", "..", "::", "<=", ">=", "==", "~=", "//", "<<", ">>")
# What follows a name that is then called or indexed
_USE: Final = frozenset({"(", ".", ":", "[", "{", "<string>"})


def _tokens(source: str) -> Iterator[str]:
    """Names, symbols, and `<string>` for each string literal; comments and numbers
    are dropped. Unterminated constructs end the stream (the compiler reports them)."""
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c.isspace():
            i += 1
            continue
        if source.startswith("--", i):
            long = _LONG_OPEN.match(source, i + 2)
            if long:
                end = source.find(f"]{long[1]}]", long.end())
                i = n if end < 0 else end + len(long[1]) + 2
            else:
                end = source.find("\n", i)
                i = n if end < 0 else end + 1
            continue
        if c in "\"'":
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
            i = j + 1
            yield "<string>"
            continue
        long = _LONG_OPEN.match(source, i)
        if long:
            end = source.find(f"]{long[1]}]", long.end())
            i = n if end < 0 else end + len(long[1]) + 2
            yield "<string>"
            continue
        name = _NAME.match(source, i)
        if name:
            i = name.end()
            yield name[0]
            continue
        number = _NUMBER.match(source, i)
        if number and number.end() > i:
            i = number.end()
            continue
        symbol = next((s for s in _SYMBOLS if source.startswith(s, i)), c)
        i += len(symbol)
        yield symbol


def _defined(tokens: list[str]) -> set[str]:
    """Names the script declares local or assigns as globals, anywhere; and function
    parameters."""
    defined: set[str] = set()
    count = len(tokens)
    for index, token in enumerate(tokens):
        if token == "function":  # its parameters: the names between its ( and )
            at = index + 1
            while at < count and tokens[at] != "(":
                at += 1
            at += 1
            while at < count and tokens[at] != ")":
                if _NAME.fullmatch(tokens[at]):
                    defined.add(tokens[at])
                at += 1
            continue
        if not _NAME.fullmatch(token) or token in _KEYWORDS:
            continue
        before = tokens[index - 1] if index else ""
        after = tokens[index + 1] if index + 1 < count else ""
        if before in (".", ":", "::", "goto"):
            continue  # a field, a method, a label
        if before in ("local", "for", "function") and after not in (".", ":"):
            defined.add(token)  # local x, for x, (local) function x
        elif after in ("=", ",", "in"):
            defined.add(token)  # x = ..., a, b = ..., local a, b, for k, v in
    return defined


def check_globals(source: str, environment: Mapping[str, frozenset[str]]) -> None:
    """Raises ScriptError naming the first call or index of something the sandbox lacks."""
    tokens = list(_tokens(source))
    defined = _defined(tokens)
    for index, token in enumerate(tokens):
        if not _NAME.fullmatch(token) or token in _KEYWORDS or token in defined:
            continue
        before = tokens[index - 1] if index else ""
        if before in (".", ":", "::", "goto"):
            continue  # a field, a method, a label
        after = tokens[index + 1] if index + 1 < len(tokens) else ""
        if after not in _USE:
            continue
        if token not in environment:
            member = tokens[index + 2] if after in (".", ":") and index + 2 < len(tokens) else ""
            used = f"{token}{after}{member}" if member and _NAME.fullmatch(member) else token
            raise ScriptError(_missing(used))
        members = environment[token]
        if members and after in (".", ":") and index + 2 < len(tokens):
            member = tokens[index + 2]
            if _NAME.fullmatch(member) and member not in members:
                raise ScriptError(_missing(f"{token}.{member}"))


def _missing(used: str) -> str:
    return (
        f"uses {used}, which the sandbox does not provide (scripts get the basic "
        "functions, string, table, math, utf8 and fila.get; no os, io, require, load, "
        "debug or string.dump)"
    )
