"""Fully sharded data parallelism: the exposed time of its per-layer collectives, and what a rank
keeps of each model state and of the layers it has gathered.

As megatron-core 0.16 runs it (Megatron-FSDP, ``distributed/fsdp/src/megatron_fsdp``; torch FSDP2
through ``torch_fully_sharded_data_parallel.py``), every micro-batch, per FSDP unit (a block of the
chunk: embedding, each transformer layer, the output layer, in forward order):

- ``optim_grads_params`` (and torch FSDP2): the unit's parameters are all-gathered over the
  data-parallel group (DP x CP ranks; an expert's over expert DP) before its forward, freed after
  it, and all-gathered again before its backward (not with torch FSDP2's
  ``reshard_after_forward`` off); its gradients are reduce-scattered after its backward
  (``grad_reduce_every_bprop``);
- ``optim_grads``: only the reduce-scatter per micro-batch; the weights are whole, all-gathered
  once after the optimizer step as the distributed optimizer does;
- ``optim`` and ``no_shard``: nothing per micro-batch; the gradients are reduced after the last
  backward, as the distributed optimizer (reduce-scatter) and DDP (all-reduce) do.

The collectives run on side streams while the units compute. Unit ``i``'s pre-forward (pre-backward)
hook issues the all-gathers of the next ``prefetch`` units not yet gathered, and the unit computes
once its own has arrived; a unit's reduce-scatter is issued when its backward ends. All of a rank's
FSDP collectives share one link, so they are served one at a time in the order issued
(:func:`exposed_ns`). ``prefetch`` is 1 with Megatron-FSDP's double buffer (two fixed buffers) and
with torch FSDP2 (its CPU issues the next unit's all-gather while the current one computes);
otherwise Megatron-FSDP prefetches units until ``suggested_AG_prefetch_size`` elements, half the
communication unit (``--suggested-communication-unit-size``, default ``max(1e9, 2 x mean unit)``
elements), are in flight beyond the current unit. What is not hidden is added to the forward and
backward of each micro-batch, the first unit's all-gather included.

Memory per rank (:func:`state_shards`, :func:`working_set_units`): each model state is divided by the
group it is sharded over when the strategy shards it; gathered weights are held for the current unit
and the prefetched ones (``1 + prefetch``; every unit of the chunk when torch FSDP2 does not reshard
after forward), unsharded gradients for the current unit and those queued for reduce-scatter (two
with the double buffer or torch FSDP2; else the queue holds up to one communication unit of
elements, ``GradReducePipeline.wait_for_previous_grad_reduce``). Bucket padding to a multiple of
the group size is left out (under 1 KiB per unit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vtrain_plugin.specs.fsdp import FsdpImplementation, FsdpSettings

# Megatron-FSDP's default communication unit: max(1e9, twice the mean FSDP unit) elements
# (MegatronFSDP.__init__); the all-gather prefetches half of it, the reduce-scatter queue holds it.
DEFAULT_COMMUNICATION_UNIT_ELEMENTS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class FsdpUnit:
    """One FSDP unit instance of a chunk, in forward order: its compute per micro-batch and the time
    of its collectives (all-gather of its parameters, reduce-scatter of its gradients)."""

    forward_ns: float
    backward_ns: float  # with its recompute
    gather_ns: float
    reduce_ns: float


def communication_unit_elements(settings: FsdpSettings, unit_numels: Sequence[int]) -> int:
    """Megatron-FSDP's communication unit in elements (see the module doc)."""
    if settings.communication_unit_elements is not None:
        return settings.communication_unit_elements
    mean = sum(unit_numels) // max(1, len(unit_numels))
    return max(DEFAULT_COMMUNICATION_UNIT_ELEMENTS, 2 * mean)


def prefetch_units(settings: FsdpSettings, unit_numels: Sequence[int]) -> int:
    """Units whose all-gathers are issued ahead of the one computing (see the module doc)."""
    if settings.prefetches_one_layer or not unit_numels:
        return 1
    ahead = communication_unit_elements(settings, unit_numels) // 2
    largest = max(unit_numels) or 1
    return max(1, min(len(unit_numels) - 1, math.ceil(ahead / largest)))


def exposed_ns(compute_ns: Sequence[float], gather_ns: Sequence[float], reduce_ns: Sequence[float],
               prefetch: int) -> float:
    """Time the units of one pass (in the order they compute) wait for their collectives, plus the
    reduce-scatters still running when the last unit ends (see the module doc)."""
    n = len(compute_ns)
    link_free = compute_free = 0.0
    gathered = [0.0] * n
    issued = 0
    for i in range(n):
        while issued < n and issued <= i + prefetch:  # the pre-hook of unit i issues up to i + prefetch
            link_free = max(link_free, compute_free) + gather_ns[issued]
            gathered[issued] = link_free
            issued += 1
        compute_free = max(compute_free, gathered[i]) + compute_ns[i]
        if reduce_ns[i]:
            link_free = max(link_free, compute_free) + reduce_ns[i]
    return max(compute_free, link_free) - sum(compute_ns)


def exposed_per_microbatch(units: Sequence[FsdpUnit], settings: FsdpSettings, prefetch: int
                           ) -> tuple[float, float]:
    """(forward, backward) time one micro-batch of a chunk waits for its FSDP collectives."""
    strategy = settings.sharding_strategy
    n = len(units)
    gathers = [u.gather_ns if strategy.shards_parameters else 0.0 for u in units]
    forward = exposed_ns([u.forward_ns for u in units], gathers, [0.0] * n, prefetch)
    backward_gathers = gathers if settings.reshard_after_forward else [0.0] * n
    reduces = [u.reduce_ns if strategy.shards_gradients else 0.0 for u in units]
    backward = exposed_ns([u.backward_ns for u in reversed(units)], backward_gathers[::-1], reduces[::-1], prefetch)
    return forward, backward


@dataclass(frozen=True, slots=True)
class StateShards:
    """How many ranks share each model state of a parameter (1: kept whole)."""

    weights: int
    gradients: int
    optimizer: int


def state_shards(settings: FsdpSettings, group_size: int) -> StateShards:
    """The shards of a parameter's weights, gradients and optimizer state over a group of ``group_size``
    (DP x CP, or expert DP for the experts' parameters) under ``settings``' strategy."""
    strategy = settings.sharding_strategy
    return StateShards(weights=group_size if strategy.shards_parameters else 1,
                       gradients=group_size if strategy.shards_gradients else 1,
                       optimizer=group_size if strategy.shards_optimizer else 1)


def working_set_units(settings: FsdpSettings, unit_numels: Sequence[int]) -> tuple[int, int]:
    """(gathered weight units, unsharded gradient units) a rank holds at most (see the module doc)."""
    n = len(unit_numels)
    if n == 0:
        return 0, 0
    strategy = settings.sharding_strategy
    weights = 0
    if strategy.shards_parameters:
        reshard = settings.reshard_after_forward
        weights = min(n, 1 + prefetch_units(settings, unit_numels)) if reshard else n
    gradients = 0
    if strategy.shards_gradients:
        if settings.double_buffer or settings.implementation is FsdpImplementation.TORCH:
            gradients = min(n, 2)
        else:
            queued = communication_unit_elements(settings, unit_numels) // (max(unit_numels) or 1)
            gradients = min(n, 1 + queued)
    return weights, gradients
