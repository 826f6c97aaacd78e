"""Fila: a durable message broker with fair scheduling, throttling and Lua policy."""

__version__ = "0.1.0"
