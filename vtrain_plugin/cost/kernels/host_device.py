"""The host/device pipeline arithmetic: how long a sequence of kernels takes when a CPU issues them.

Within one phase of a task, the CPU issues kernels and the GPU runs them as an in-order two-stage
pipeline: kernel i is issued after kernel i-1 (``host_i`` each) and runs once issued and once kernel
i-1 is done. Starting idle, a sequence ends at ``P = max_k (sum_{i<=k} host_i + sum_{i>=k} device_i)``:
at least the larger of the two sums, at most their total. On a device whose host runs the kernels
itself (``DeviceSpec.host_runs_kernels``, the CPU) the two simply add up.

A segment (one phase of one block instance: consecutive rows of a stage's kernel batch) is summarised
by its host total ``H``, device total ``D`` and pipelined time ``P``; ``n`` repetitions of a layer
take ``P + (n-1) max(H, D)``, and a segment followed by another takes ``max(P1 + D2, H1 + P2)``, so a
phase of a chunk is timed exactly without expanding its layers.

A host synchronisation (the host reads a device value, :mod:`vtrain_plugin.cost.host_syncs`) drains
the pipeline: the host waits until the device has run every kernel issued so far, so the host time
of the kernels after it is no longer hidden behind a queue. A segment with such waits carries the
``(H, D, P)`` of its pieces between them, and :func:`sequence` walks their instances one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vtrain_plugin.core.graph import Phase


@dataclass(frozen=True, slots=True)
class Segment:
    """One phase of one block instance: rows ``[start, stop)`` of its stage's kernel batch."""

    block: int  # index in the stage's blocks
    phase: Phase
    start: int
    stop: int
    count: int  # instances of the block (layers of a folded template)


@dataclass(frozen=True, slots=True)
class SegmentTime:
    """Host total, device total and pipelined time of a segment, and how often it repeats."""

    host_ns: float
    device_ns: float
    pipelined_ns: float
    count: int
    # With host synchronisations inside: (host, device, pipelined) of each piece, the host waiting
    # for the device before every piece but the first; empty: none.
    pieces: tuple[tuple[float, float, float], ...] = ()


def _bounds(segments: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray]:
    starts = np.fromiter((s.start for s in segments), int, len(segments))
    stops = np.fromiter((s.stop for s in segments), int, len(segments))
    return starts, stops


def segment_sums(values: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
    """Per segment, the sum of ``values`` over its rows."""
    c = np.concatenate(([0.0], np.cumsum(values)))
    starts, stops = _bounds(segments)
    return c[stops] - c[starts]


def segment_times(host: np.ndarray, device: np.ndarray, segments: Sequence[Segment]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per segment: host total, device total and the two-stage pipeline time of its kernels.

    With global prefix sums ``CH``, ``CD``, ``P = max_i (CH_i - CD_{i-1}) - CH_{start-1} + CD_{stop-1}``,
    the maximum over the segment's own rows ``start <= i < stop``: the segments need not cover the
    batch (:func:`split_times` times the pieces of one segment).
    """
    ch = np.concatenate(([0.0], np.cumsum(host)))
    cd = np.concatenate(([0.0], np.cumsum(device)))
    starts, stops = _bounds(segments)
    h = ch[stops] - ch[starts]
    d = cd[stops] - cd[starts]
    p = np.zeros(len(segments))
    nonempty = stops > starts
    if nonempty.any() and len(host):
        value = ch[1:] - cd[:-1]  # CH_i - CD_{i-1} for row i (inclusive prefix of host)
        # reduceat over (start, stop) pairs: the even results are the maxima over [start, stop); the
        # sentinel lets a stop at the end of the batch be an index.
        bounds = np.column_stack((starts[nonempty], stops[nonempty])).ravel()
        peak = np.maximum.reduceat(np.append(value, -np.inf), bounds)[::2]
        p[nonempty] = peak - ch[starts[nonempty]] + cd[stops[nonempty]]
    return h, d, p


def _joined(first: tuple[float, float, float], second: tuple[float, float, float]) -> tuple[float, float, float]:
    """(H, D, P) of two runs of kernels issued one after the other with no wait between."""
    (h1, d1, p1), (h2, d2, p2) = first, second
    pipelined = max(p1 + d2, h1 + p2) if p1 and p2 else p1 + p2
    return h1 + h2, d1 + d2, pipelined


def _walk(total_h: float, total_p: float, pieces: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Host and pipeline clocks after ``pieces``, the host waiting for the device before each but the first."""
    for i, (h, _d, p) in enumerate(pieces):
        if i:
            total_h = max(total_h, total_p)
        if p:
            total_p = max(total_p + _d, total_h + p)
        total_h += h
    return total_h, total_p


def split_times(host: np.ndarray, device: np.ndarray, segment: Segment, waits: Sequence[int]
                ) -> tuple[tuple[float, float, float], ...]:
    """The pieces of ``segment`` between the rows ``waits`` (sorted, inside it) before which the host
    waits for the device: each piece's (H, D, P)."""
    bounds = [segment.start, *waits, segment.stop]
    parts = [Segment(block=segment.block, phase=segment.phase, start=a, stop=b, count=1)
             for a, b in zip(bounds, bounds[1:])]
    h, d, p = segment_times(host, device, parts)
    return tuple(zip(h.tolist(), d.tolist(), p.tolist()))


def drained_ns(pieces: Sequence[tuple[float, float, float]]) -> float:
    """Time from an empty queue until the host, having waited for the device before each of
    ``pieces`` but the first and after the last, sees the last one done."""
    total_h, total_p = _walk(0.0, 0.0, pieces)
    return max(total_h, total_p)


def then(first: SegmentTime, second: SegmentTime) -> SegmentTime:
    """One instance of ``first`` followed by one of ``second``, as one pipelined unit."""
    pieces: tuple[tuple[float, float, float], ...] = ()
    if first.pieces or second.pieces:
        a = first.pieces or ((first.host_ns, first.device_ns, first.pipelined_ns),)
        b = second.pieces or ((second.host_ns, second.device_ns, second.pipelined_ns),)
        pieces = (*a[:-1], _joined(a[-1], b[0]), *b[1:])
        pipelined = _walk(0.0, 0.0, pieces)[1]
    else:
        pipelined = _joined((first.host_ns, first.device_ns, first.pipelined_ns),
                            (second.host_ns, second.device_ns, second.pipelined_ns))[2]
    return SegmentTime(host_ns=first.host_ns + second.host_ns, device_ns=first.device_ns + second.device_ns,
                       pipelined_ns=pipelined, count=first.count, pieces=pieces)


def sequence(parts: Iterable[SegmentTime]) -> float:
    """Pipelined time of segments run one after another, each repeated ``count`` times."""
    total_h = total_d = total_p = 0.0
    for part in parts:
        n = part.count
        if n == 0 or part.pipelined_ns == 0.0:
            continue
        if part.pieces:  # the waits inside keep instances from overlapping: walk each
            for _ in range(n):
                total_h, total_p = _walk(total_h, total_p, part.pieces)
            total_d += n * part.device_ns
            continue
        rep_p = part.pipelined_ns + (n - 1) * max(part.host_ns, part.device_ns)
        total_p = max(total_p + n * part.device_ns, total_h + rep_p)
        total_h += n * part.host_ns
        total_d += n * part.device_ns
    return total_p
