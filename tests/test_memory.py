"""The heap trimmer (`fila.server.memory`): freed memory goes back to the system after
growth, in this very process (glibc only)."""

from __future__ import annotations

import pytest
from support import wait_until

from fila.server.memory import HeapTrimmer, TrimPolicy, _malloc_trim, resident_bytes

MIB = 1024 * 1024


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_memory_freed_below_a_live_block_is_returned_after_growth() -> None:
    trim = _malloc_trim()
    assert trim is not None
    # Stepped by hand, not by the trimmer's thread: a thread could trim between the
    # `del` and the check that free() alone gave nothing back (seen once under load).
    # Memory earlier tests of this process freed would come back with the first trim
    # and count as given back: give it back first.
    trim(0)
    policy = TrimPolicy(trim, interval_s=1.0, growth_bytes=32 * MIB)
    # 2 KB blocks come from malloc, not Python's small-object pools; the block
    # allocated after them keeps the heap's top in use, so free() cannot give the
    # space back by itself and only malloc_trim can.
    blocks = [bytes(2000) for _ in range(60_000)]
    top = bytes(2000)
    policy.step()  # grown, but all of it in use: a trim that gives back little
    assert policy.wait_s == 2.0, "a trim that gave back little doubles the wait"
    grown = resident_bytes()
    del blocks
    assert resident_bytes() > grown - 16 * MIB, "free() returned it alone; no test"
    policy.step()
    assert resident_bytes() < grown - 64 * MIB, "the trim gave the freed memory back"
    assert policy.wait_s == 1.0, "a trim that gave back much resets the wait"
    assert top


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_the_trimmer_thread_trims_and_stops() -> None:
    trimmer = HeapTrimmer(interval_s=0.05, growth_bytes=32 * MIB)
    trimmer.start()
    try:
        blocks = [bytes(2000) for _ in range(60_000)]
        top = bytes(2000)
        grown = resident_bytes()
        del blocks
        wait_until(
            lambda: resident_bytes() < grown - 64 * MIB,
            timeout=10,
            what="RSS to drop after the trimmer ran",
        )
        assert top
    finally:
        trimmer.stop()
