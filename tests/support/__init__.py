"""Helpers shared by the test modules (importable as `support`; tests/ is on sys.path)."""

from __future__ import annotations

from collections.abc import Callable

from fila.server.process import ServerProcess

# The `server_factory` fixture: make(config_toml=, env=, persist_mode=, start=, timeout=).
ServerFactory = Callable[..., ServerProcess]

__all__ = ["ServerFactory", "ServerProcess"]
