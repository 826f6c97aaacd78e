"""Scheduled view of a queue: the messages waiting out a delay, with when each becomes
ready, and the leased ones, with their lease deadlines and attempt numbers.

The counts come from the sampler (one `GetStats`, so they add up: depth is ready plus
delayed, in flight is the leased) and refresh live; the lists are `PeekMessages` pages
filtered by state, in id order, each paged on its own, and change nothing.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fila.dashboard.context import of
from fila.dashboard.render import fragment, page
from fila.dashboard.views.queue import PAGE_SIZE, browse, known_view, not_found, queue_view
from fila.v1 import admin_pb2


async def scheduled_page(request: Request) -> Response:
    name = request.path_params["name"]
    view = await known_view(request, name)
    if view is None:
        return not_found(request, name)
    delayed = await browse(request, name, state=admin_pb2.DELAYED, after_param="delayed_after")
    leased = await browse(request, name, state=admin_pb2.LEASED, after_param="leased_after")
    context = {"q": view, "delayed": delayed, "leased": leased, "page_size": PAGE_SIZE}
    return page(request, "scheduled.html", context)


async def scheduled_live(request: Request) -> Response:
    name = request.path_params["name"]
    return fragment(request, "_scheduled_live.html", {"q": queue_view(of(request).sampler, name)})


routes = [
    Route("/queues/{name:str}/scheduled", scheduled_page),
    Route("/live/queues/{name:str}/scheduled", scheduled_live),
]
