"""One module per broker, each behind the interface in `base`.

Adapters are imported on demand: each needs its broker's client library (the optional
`bench` extra), and a run over `fila,redis` must not require `aio-pika`.
"""

from __future__ import annotations

import importlib
from typing import Final

from competitive.adapters.base import BrokerAdapter

NAMES: Final = ("fila", "redis", "nats", "rabbitmq", "beanstalkd")
_CLASSES: Final = {
    "fila": "Fila",
    "redis": "Redis",
    "nats": "Nats",
    "rabbitmq": "RabbitMQ",
    "beanstalkd": "Beanstalkd",
}


def load(name: str) -> type[BrokerAdapter]:
    """The adapter class for a broker name (`fila`, `redis`, ...)."""
    if name not in _CLASSES:
        raise KeyError(f"unknown broker {name!r}; choose from {', '.join(NAMES)}")
    module = importlib.import_module(f"competitive.adapters.{name}")
    cls = getattr(module, _CLASSES[name])
    assert isinstance(cls, type) and issubclass(cls, BrokerAdapter)
    return cls


__all__ = ["NAMES", "BrokerAdapter", "load"]
