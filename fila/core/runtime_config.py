"""The persistent runtime key-value store read by Lua (`fila.get`) and the throttle manager.

Values are validated here before anything is written, so a malformed
`throttle.*` value is refused with INVALID_ARGUMENT and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from fila.core.errors import InvalidArgument, clip
from fila.core.throttle import THROTTLE_PREFIX, parse_throttle_value

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ThrottleChange:
    """What a config write means for a throttle bucket; rate None = bucket removed."""

    key: str
    rate: float | None = None
    burst: float | None = None


def validate_entry(key: str, value: str) -> ThrottleChange | None:
    """Raises InvalidArgument for a bad key or value; returns the throttle change it implies."""
    if not key:
        raise InvalidArgument("config key must not be empty")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"config key is longer than {MAX_KEY_BYTES} bytes")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise InvalidArgument(
            f'config value for "{clip(key)}" is longer than {MAX_VALUE_BYTES} bytes'
        )
    if not key.startswith(THROTTLE_PREFIX):
        return None
    throttle_key = key[len(THROTTLE_PREFIX) :]
    if not throttle_key:
        raise InvalidArgument('"throttle." needs a throttle key after the dot')
    if value == "":
        return ThrottleChange(throttle_key)
    try:
        rate, burst = parse_throttle_value(value)
    except ValueError as exc:
        raise InvalidArgument(f'bad value for "{clip(key)}": {exc}') from None
    return ThrottleChange(throttle_key, rate, burst)


class RuntimeConfig:
    """In-memory mirror of the `c` keys; the broker persists every change."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self._values.get(key)

    def set(self, key: str, value: str) -> None:
        if value == "":
            self._values.pop(key, None)
        else:
            self._values[key] = value

    def items(self, prefix: str = "") -> list[tuple[str, str]]:
        return sorted((k, v) for k, v in self._values.items() if k.startswith(prefix))
