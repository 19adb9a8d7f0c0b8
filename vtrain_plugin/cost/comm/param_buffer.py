"""Megatron-Core's gradient and parameter buffer of one model chunk under the distributed optimizer:
which parameters share a bucket, and each bucket's padded size (what is reduce-scattered and
all-gathered over the data-parallel group).

As megatron-core 0.16 lays it out (``_ParamAndGradBuffer.__init__`` in
``distributed/param_and_grad_buffer.py``, ``DistributedDataParallel.__init__``):

- parameters in reverse ``named_parameters`` order (roughly the order backward produces their
  gradients), each starting at a multiple of 64 elements;
- a bucket closes once it spans ``bucket_size`` elements, and its end is padded to a multiple of
  ``lcm(DP, 128)`` elements so that it shards evenly over the DP ranks;
- ``bucket_size`` is Megatron-Core's ``max(40M, 1M x DP)`` elements unless given, and unbounded (one
  bucket per chunk) without ``overlap_grad_reduce``, on pipeline ranks after the first (their
  reduction is off the critical path) and for model chunks after the first (Megatron-LM builds them
  with ``disable_bucketing``, which also makes their buckets one group, communicated together);
- with tied embeddings over a pipeline the shared word embedding (first stage) or output weight
  (last stage) gets a bucket of its own, so that its reduce-scatter can precede the embedding
  all-reduce.

Bucket sizes count elements; the reduce-scatter moves them in the gradient dtype, the all-gather in
the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vtrain_plugin.core.units import MEGABYTE
from vtrain_plugin.specs.training import default_bucket_elements

PARAM_ALIGNMENT = 64  # elements: every parameter starts 128-byte aligned
BUCKET_ALIGNMENT = 128  # elements: every bucket ends 256-byte aligned (and divisible by DP)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket: its padded size and the parameters it holds, by forward-order index."""

    numel: int  # padded elements
    first_param: int  # the earliest parameter in forward order: needed first, its gradient ready last
    last_param: int


def bucket_elements(bucket_size_mb: float | None, *, data_parallel: int, grad_nbytes: int) -> int:
    """Elements per bucket: ``bucket_size_mb`` of gradients, else Megatron-Core's default."""
    if bucket_size_mb is None:
        return default_bucket_elements(data_parallel)
    return max(1, int(bucket_size_mb * MEGABYTE) // grad_nbytes)


def chunk_buckets(param_numels: Sequence[int], *, data_parallel: int, bucket_size: int | None,
                  shared_embedding: int | None = None) -> tuple[Bucket, ...]:
    """The buckets of a chunk whose parameters have ``param_numels`` elements (forward order), in
    the order they are laid out (backward order). ``bucket_size`` None: no size limit;
    ``shared_embedding``: forward index of the parameter that gets a bucket of its own."""
    divisor = math.lcm(data_parallel, BUCKET_ALIGNMENT)
    buckets: list[Bucket] = []
    bucket_start = start = 0
    members: list[int] = []

    def close(end: int) -> int:
        padded = _pad(end, divisor)
        buckets.append(Bucket(numel=padded - bucket_start, first_param=min(members), last_param=max(members)))
        members.clear()
        return padded

    for index in reversed(range(len(param_numels))):
        start = _pad(start, PARAM_ALIGNMENT)
        alone = index == shared_embedding
        if alone and members:
            start = bucket_start = close(start)
        end = start + param_numels[index]
        members.append(index)
        if alone or (bucket_size is not None and end - bucket_start >= bucket_size):
            start = bucket_start = close(end)
        else:
            start = end
    if members:
        close(start)
    return tuple(buckets)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor
