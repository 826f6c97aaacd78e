"""Median, min and max over repetitions, and latency percentiles.

These machines are noisy (two shared cores), so every cell is repeated and reported
as its median with the range beside it; a single repetition is never presented as a
stable figure. Latency percentiles come from an HDR histogram (the library the
self-benchmark uses): microsecond resolution, three significant digits, no binning
choices of our own.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from itertools import groupby

from hdrh.histogram import HdrHistogram

from competitive.model import NOT_AVAILABLE, OK, CellKey, Measurement, Row

# Latencies are recorded in microseconds from 1 us to 60 s.
_HDR_LOWEST_US = 1
_HDR_HIGHEST_US = 60_000_000
_HDR_DIGITS = 3


def latency_percentiles_ms(samples_s: Iterable[float], percentiles: Sequence[float]) -> list[float]:
    """Percentiles (e.g. 50, 99, 99.9) of round-trip times given in seconds, in ms."""
    hist = HdrHistogram(_HDR_LOWEST_US, _HDR_HIGHEST_US, _HDR_DIGITS)
    count = 0
    for seconds in samples_s:
        micros = min(max(round(seconds * 1e6), _HDR_LOWEST_US), _HDR_HIGHEST_US)
        hist.record_value(micros)
        count += 1
    if count == 0:
        raise ValueError("no latency samples")
    return [hist.get_value_at_percentile(p) / 1000.0 for p in percentiles]


def summarize(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of one cell's repetitions."""
    if not values:
        raise ValueError("no values to summarize")
    return statistics.median(values), min(values), max(values)


def aggregate(measurements: Iterable[Measurement]) -> list[Row]:
    """One row per cell: the median of the repetitions that produced a value.

    A cell is `ok` only when every repetition was. Otherwise `conservation` lists what
    went wrong, per repetition, and the value (if any repetition measured one) is kept
    beside that flag: a failing run is reported as failing, never dropped or cleaned.
    """
    rows: list[Row] = []
    ordered = sorted(measurements, key=lambda m: m.key)
    for key, group in groupby(ordered, key=lambda m: m.key):
        rows.append(_row(key, list(group)))
    return rows


def _row(key: CellKey, reps: list[Measurement]) -> Row:
    values = [m.value for m in reps if m.value is not None]
    unavailable = [m for m in reps if m.status.startswith(NOT_AVAILABLE)]
    notes = list(dict.fromkeys(m.note for m in reps if m.note))
    if unavailable and len(unavailable) == len(reps):
        conservation = unavailable[0].status
    else:
        problems = [
            f"rep {i}: {m.status}" if len(reps) > 1 else m.status
            for i, m in enumerate(reps, start=1)
            if m.status != OK
        ]
        conservation = "; ".join(problems) if problems else OK
    median = low = high = None
    if values:
        median, low, high = summarize(values)
    return Row(
        broker=key.broker,
        mode=key.mode,
        batching=key.batching,
        workload=key.workload,
        connections=key.connections,
        payload_bytes=key.payload_bytes,
        value=median,
        unit=reps[0].unit,
        min=low,
        max=high,
        reps=len(values),
        conservation=conservation,
        note="; ".join(notes),
    )
