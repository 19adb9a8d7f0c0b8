"""The simulated iteration as intervals per pipeline rank and stream, and its Chrome/Perfetto export.

The export is the Trace Event Format: complete ("X") events with ``ts``/``dur`` in microseconds, one
process per pipeline rank and one thread per stream, named by metadata ("M") events. Open it in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.files import atomic_write_text


class Stream(StrEnum):
    COMPUTE = "compute"
    PP_SEND = "pp_send"
    DP = "dp"


class IntervalKind(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    PP_COMM = "pp_comm"
    DP_COMM = "dp_comm"
    EMBEDDING_SYNC = "embedding_sync"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    stream: Stream
    kind: IntervalKind
    label: str
    start_ns: float
    end_ns: float
    chunk: int | None = None  # model chunk on the rank, for per-micro-batch work
    microbatch: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    ranks: tuple[tuple[Interval, ...], ...]  # per pipeline rank, in the order they were simulated
    iteration_ns: float


_NS_PER_US = 1000.0


def to_chrome_trace(timeline: Timeline, *, max_ranks: int | None = None,
                    max_microbatches: int | None = None) -> dict[str, Any]:
    """Trace events of ``timeline``.

    ``max_ranks`` keeps that many pipeline ranks, evenly spread and always including the first and
    the last; ``max_microbatches`` drops the per-micro-batch intervals of later micro-batches.
    """
    ranks = _kept_ranks(len(timeline.ranks), max_ranks)
    if max_microbatches is not None:
        v.positive_int("max_microbatches", max_microbatches)
    tids = {stream: i for i, stream in enumerate(Stream)}
    events: list[dict[str, Any]] = []
    for rank in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"pipeline rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for stream, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": stream.value}})
        for iv in timeline.ranks[rank]:
            if max_microbatches is not None and iv.microbatch is not None and iv.microbatch >= max_microbatches:
                continue
            args = {} if iv.microbatch is None else {"chunk": iv.chunk, "microbatch": iv.microbatch}
            events.append({"name": iv.label, "cat": iv.kind.value, "ph": "X", "pid": rank,
                           "tid": tids[iv.stream], "ts": iv.start_ns / _NS_PER_US,
                           "dur": (iv.end_ns - iv.start_ns) / _NS_PER_US, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"iteration_ms": timeline.iteration_ns / 1e6}}


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike, *, max_ranks: int | None = None,
                       max_microbatches: int | None = None) -> None:
    trace = to_chrome_trace(timeline, max_ranks=max_ranks, max_microbatches=max_microbatches)
    atomic_write_text(Path(path), json.dumps(trace, separators=(",", ":")))


def _kept_ranks(num_ranks: int, max_ranks: int | None) -> list[int]:
    if max_ranks is not None:
        v.positive_int("max_ranks", max_ranks)
    if max_ranks is None or max_ranks >= num_ranks:
        return list(range(num_ranks))
    if max_ranks == 1:
        return [0]
    step = (num_ranks - 1) / (max_ranks - 1)
    return sorted({round(i * step) for i in range(max_ranks)})
