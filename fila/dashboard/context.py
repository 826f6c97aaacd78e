"""The per-process objects every route needs, reached from the request.

Built once by `fila.dashboard.app.create_app` and stored on `app.state`; routes call
`of(request)` instead of importing globals, so tests can build as many apps as they
like in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from starlette.requests import Request

from fila.dashboard.auth import TokenGate
from fila.dashboard.broker import Broker
from fila.dashboard.flash import Flasher
from fila.dashboard.sampler import Sampler


@dataclass(frozen=True, slots=True)
class Dashboard:
    broker: Broker
    sampler: Sampler
    gate: TokenGate
    flasher: Flasher
    version: str
    read_only: bool  # see `fila.dashboard.readonly`


def of(request: Request) -> Dashboard:
    return cast(Dashboard, request.app.state.dashboard)
