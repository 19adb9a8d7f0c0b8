"""A chunk's trace at any micro-batch size, derived from its traces at two others.

A transformer chunk's ops do not depend on the micro-batch size, only their sizes do, and each size
(a shape's dimension, an argument, FLOPs, bytes, saved bytes, the activation sent on) is affine in
it: ``c0 + c1 * b``, the batch being one factor of every activation and none of the weights. Two
traces at consecutive sizes ``b`` and ``b + 1`` (:data:`PROBES`) therefore give every size at any
micro-batch of 2 or more, exactly (at 1 some ops launch nothing: a transposed ``[s, 1, h]`` is
already contiguous, so that size is traced): :func:`rescale` walks the two traces in step and extrapolates each number that
differs. Anything else that differs (the ops, their order, a string, a float, a flag) means the two
are not one trace at two sizes, and nothing is derived. tests/integration/test_rescaled_traces.py
checks derived against traced op by op for dense, MoE and hybrid chunks.

Why: a plan search needs each chunk shape at up to a dozen micro-batch sizes; tracing two of them
instead of each is most of a cold search's time.
"""

from __future__ import annotations

from typing import Any

from vtrain_plugin.capture.chunk import ChunkTrace

# The micro-batch sizes traced to derive the others (those from 2 up): consecutive, so every slope is an
# integer; not 1, whose size-1 dimensions an op may treat apart.
PROBES = (2, 3)


class _NotAffine(Exception):
    """The two traces differ in more than sizes."""


def rescale(low: ChunkTrace, high: ChunkTrace, micro_batch_size: int) -> ChunkTrace | None:
    """The trace at ``micro_batch_size`` of the chunk traced as ``low`` at ``PROBES[0]`` and ``high``
    at ``PROBES[1]``; None below ``PROBES[0]`` or when the two differ in more than sizes."""
    if micro_batch_size < PROBES[0]:
        return None
    try:
        derived = _derive(low.to_dict(), high.to_dict(), micro_batch_size - PROBES[0])
    except _NotAffine:
        return None
    return ChunkTrace.from_dict(derived)


def _derive(low: Any, high: Any, steps: int) -> Any:
    """``low`` with each int that differs from ``high``'s moved ``steps`` times the difference."""
    if type(low) is not type(high):
        raise _NotAffine
    if type(low) is int:  # not bool: a flag that changes is not a size
        return low + steps * (high - low)
    if isinstance(low, dict):
        if low.keys() != high.keys():
            raise _NotAffine
        return {k: _derive(low[k], high[k], steps) for k in low}
    if isinstance(low, (list, tuple)):
        if len(low) != len(high):
            raise _NotAffine
        return [_derive(a, b, steps) for a, b in zip(low, high)]
    if low != high:
        raise _NotAffine
    return low
