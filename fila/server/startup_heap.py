"""Keeps what startup built out of the cyclic garbage collector's full collections.

CPython's reference counting frees most objects; its cyclic collector looks for
cycles, and a full (generation 2) collection visits every object the collector
tracks, however old. In a serving broker most of those were made at startup and live
until it exits: modules, classes, functions, protobuf descriptors, the gRPC server.
A full collection stops the event loop while it runs, so it is a pause every call in
flight waits out, and most of what it visits is startup's: freezing those makes the
pauses a small fraction of what they were (figures: docs/benchmarks.md,
"Measurements behind design choices").

`gc.freeze()` moves every tracked object to a permanent generation that collections
skip. Frozen objects are still freed by reference counting when dropped; only a cycle
among them would never be collected, and cycles built at startup live as long as the
process anyway. Startup's own garbage is collected first, so none of it is kept.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects startup's garbage, then freezes what is left; returns how many objects
    the collector now skips. Called once, just before the broker starts serving."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
