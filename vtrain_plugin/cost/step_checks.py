"""Megatron-LM's per-step host work outside the model: the NaN / Inf checks of the loss and of the
gradients, per-token loss normalisation and Python's garbage collector, as kernels, host reads and
collectives.

Why: the functional-test runs are host-bound, and each of these adds launches, or makes the host wait
for the device (a host read, ``.item()`` / ``bool(tensor)``), so that the host work after it hides
behind no kernel (:mod:`vtrain_plugin.cost.kernels.host_device`). What megatron-core 0.16 and
Megatron-LM's ``pretrain_gpt.py`` do:

- NaN checks (on unless ``--no-check-for-nan-in-loss-and-grad``): the loss function validates each
  micro-batch's local loss with ``torch.isnan`` then ``torch.isinf`` (``rerun_state_machine
  .validate_result``, its ``if rejection_func(result)`` a host read each); DDP's ``check_grads``
  (``check_for_nan_in_grad``, from the same flag) takes, before each bucket's reduction
  (``start_grad_sync``), the L2 norm of the bucket's gradients (a read of its bytes) and validates it
  twice the same way. Buckets: the chunk's dense and expert gradient buffers, split at the DDP bucket
  size with overlapped reduction, one bucket each otherwise. The loss's checks are per micro-batch on
  the stage holding the loss, the gradients' once per step and chunk, priced after the backward.
- The loss of a micro-batch (``forward_step``, not per-token) is divided by its clamped token count
  and by the number of micro-batches: three small kernels. With ``--calculate-per-token-loss`` they
  are gone; instead ``finalize_model_grads`` broadcasts the token count over the pipeline group,
  all-reduces it over DP x CP, reads ``num_tokens > 0`` on the host per chunk and scales every
  gradient of the chunk's buffers by its inverse (a read and a write of each gradient).
- Garbage collection: the per-kernel host costs are fitted on runs with Python's automatic collector,
  whose pauses are inside them (:data:`GC_HOST_SHARE`); ``--manual-gc`` disables it, so the steps pay
  that share less, and collects fully every ``--manual-gc-interval`` steps
  (:data:`FULL_COLLECT_NS` each, amortised over the interval).

Under FSDP the loss's checks run (the loss function's), the gradients' do not (:func:`applies`).
Not priced: the pre-reduction scaling of each bucket by 1 / DP (``gradient_scaling_factor``, which
per-token loss also removes), per-token loss under FSDP, and Megatron-DeepSpeed's own checks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from vtrain_plugin.core.graph import BlockKind, CollectiveKind, KernelKey, OpNode, ParallelGroup, Phase, StageGraph
from vtrain_plugin.cost.kernels.host_device import Segment, drained_ns, split_times
from vtrain_plugin.cost.kernels.model import KernelBatch
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import GradReduce, SoftwareStack, TrainingSpec

# Python's automatic collector's share of the host time of a megatron-core GPT step on the CPU:
# gc.callbacks timed its pauses at 0.02-0.13% of the step's CPU time (medians and means of 5 rounds of
# 20 steps of a 4-layer GPT in three runs, benchmarks/speed/gc_pauses.py, results in
# benchmarks/results/2026-12-04_step_host_flags.txt); range [0.0002, 0.005]. Scaled with the rest of
# the host cost by host_time_factor.
GC_HOST_SHARE = 0.001
# One full gc.collect() of a training process: 0.20 s of CPU (0.6 s wall on a loaded 2-core machine)
# over 0.41 million tracked objects, in that benchmark's process (torch and megatron-core loaded); a
# Megatron-LM process holds at least as many. Range [1e8, 1e9] ns, times host_time_factor.
FULL_COLLECT_NS = 2e8

_SCALAR = ((),)
_FP32 = ("float32",)
_NORM = "aten.linalg_vector_norm.default"
_READ = "aten._to_copy.default"  # .item() / bool(tensor): a scalar copied to the host, which waits for it
_SCALE = "aten.mul_.Scalar"
_LOSS = "loss"


def _kernel(op: str, nbytes: int = 8, shape=_SCALAR, dtypes=_FP32) -> OpNode:
    return OpNode(key=KernelKey(op=op, input_shapes=shape, dtypes=dtypes), phase=Phase.OPTIMIZER, module=_LOSS,
                  nbytes=nbytes)


def _check(op: str) -> tuple[OpNode, ...]:
    """One ``validate_result``: the rejection kernel ``op`` on a scalar and the host's read of its result."""
    return _kernel(op), _kernel(_READ)


_NAN, _INF = "aten.isnan.default", "aten.isinf.default"


@dataclass(frozen=True, slots=True)
class Piece:
    """Kernels the host issues, then (``wait``) waits for the device to run them all."""

    kernels: tuple[OpNode, ...]
    collectives: tuple[tuple[CollectiveKind, int, ParallelGroup], ...] = ()
    wait: bool = True


def applies(training: TrainingSpec, stack: SoftwareStack, *, gradients: bool = True) -> bool:
    """Whether the run's loop makes these checks: Megatron-LM's over megatron-core (``stack``: the
    software stack the run resolves to, not ``training.software_stack``, which may leave it to the
    GPU), not Megatron-DeepSpeed's. The loss's checks are its loss function's, whatever shards the
    model; the gradients' are megatron-core DDP's (``gradients``): Megatron-FSDP (0.16) takes a
    ``check_for_nan_in_grad`` setting but checks nothing with it, and torch FSDP2 has none."""
    return stack is not SoftwareStack.MEGATRON_DEEPSPEED_2023 and (not gradients or training.fsdp is None)


def holds_loss(stage: StageGraph) -> bool:
    return any(b.kind is BlockKind.HEAD for b in stage.blocks)


def loss_pieces(training: TrainingSpec, stack: SoftwareStack) -> tuple[Piece, ...]:
    """What the stage holding the loss runs per micro-batch after its forward (module doc)."""
    if not applies(training, stack, gradients=False):
        return ()
    return _loss_pieces(training.nan_checks, training.per_token_loss)


@lru_cache(maxsize=4)
def _loss_pieces(nan_checks: bool, per_token_loss: bool) -> tuple[Piece, ...]:
    divide = () if per_token_loss else (_kernel("aten.clamp.default"), _kernel("aten.div_.Tensor"),
                                                 _kernel("aten.div_.Scalar"))
    if not nan_checks:
        return (Piece(divide, wait=False),) if divide else ()
    return Piece(divide + _check(_NAN)), Piece(_check(_INF))


def gradient_buffers(stage: StageGraph, grad_nbytes: int) -> tuple[int, int]:
    """Bytes of the chunk's dense and expert gradient buffers (every local gradient, unsharded)."""
    expert = sum(b.num_expert_parameters * b.count for b in stage.blocks)
    dense = sum(b.num_parameters * b.count for b in stage.blocks) - expert
    return dense * grad_nbytes, expert * grad_nbytes


def buckets(buffers: Sequence[int], training: TrainingSpec, data_parallel: int, grad_nbytes: int) -> tuple[int, ...]:
    """Bytes of each DDP bucket of ``buffers`` (module doc)."""
    limit = training.bucket_nbytes(data_parallel, grad_nbytes) if training.grad_reduce is GradReduce.OVERLAP else 0
    return _buckets(tuple(buffers), limit)


def _buckets(buffers: tuple[int, ...], limit: int) -> tuple[int, ...]:
    out: list[int] = []
    for nbytes in buffers:
        while nbytes > 0:
            size = min(nbytes, limit) if limit else nbytes
            out.append(size)
            nbytes -= size
    return tuple(out)


def step_pieces(stage: StageGraph, training: TrainingSpec, parallel: ParallelPlan, grad_nbytes: int,
                stack: SoftwareStack) -> tuple[Piece, ...]:
    """What one chunk runs once per step (module doc)."""
    if not applies(training, stack):
        return ()
    buffers = gradient_buffers(stage, grad_nbytes)
    return _step_pieces(buckets(buffers, training, parallel.grad_reduce_group_size, grad_nbytes) if
                        training.nan_checks else (), buffers if training.per_token_loss else (),
                        parallel.pipeline_parallel, parallel.grad_reduce_group_size, grad_nbytes)


@lru_cache(maxsize=256)
def _step_pieces(checked: tuple[int, ...], scaled: tuple[int, ...], pipeline_parallel: int, data_parallel: int,
                 grad_nbytes: int) -> tuple[Piece, ...]:
    """The pieces of NaN checks over the buckets ``checked`` and of per-token loss scaling ``scaled``
    (empty: off), one tuple per distinct input, which :func:`pieces_ns` looks up by identity."""
    pieces: list[Piece] = []
    if checked:
        for nbytes in checked:
            norm = _kernel(_NORM, nbytes=nbytes, shape=((nbytes // grad_nbytes,),))
            pieces += [Piece((norm, *_check(_NAN))), Piece(_check(_INF))]
    if scaled:
        collectives = tuple((kind, 4, group) for kind, group, size in (
            (CollectiveKind.BROADCAST, ParallelGroup.PP, pipeline_parallel),
            (CollectiveKind.ALL_REDUCE, ParallelGroup.DP, data_parallel)) if size > 1)
        scale = tuple(_kernel(_SCALE, nbytes=2 * nbytes, shape=((nbytes // grad_nbytes,),)) for nbytes in scaled
                      if nbytes)
        pieces += [Piece((_kernel("aten.gt.Scalar"), _kernel(_READ)), collectives), Piece(scale, wait=False)]
    return tuple(pieces)


_CACHE_SIZE = 512
_timed: OrderedDict[tuple, tuple[Sequence[Piece], float]] = OrderedDict()


def pieces_ns(pieces: Sequence[Piece], timer, comm, pipeline_rank: int) -> float:
    """Time from an empty launch queue until the device has run ``pieces`` and the host has seen
    every wait: each kernel's host and device time by ``timer``, a collective's by ``comm`` (looked
    up when a plan before timed the same pieces alike: a search costs many)."""
    if not pieces:
        return 0.0
    comm_ns = tuple(comm.time_ns(kind, nbytes, group, pipeline_rank=pipeline_rank)
                    for piece in pieces for kind, nbytes, group in piece.collectives)
    key = (id(pieces), timer.device, timer.constants, timer.model.allow_tf32, timer.slowdown, comm_ns)
    hit = _timed.get(key)
    if hit is None or hit[0] is not pieces:  # the entry holds the pieces, so their id stays theirs
        hit = _timed[key] = (pieces, _pieces_ns(pieces, timer, iter(comm_ns)))
        if len(_timed) > _CACHE_SIZE:
            _timed.popitem(last=False)
    else:
        _timed.move_to_end(key)
    return hit[1]


def _pieces_ns(pieces: Sequence[Piece], timer, comm_ns) -> float:
    c = timer.constants
    nodes = [n for piece in pieces for n in piece.kernels]
    batch = KernelBatch.of(nodes)
    kernel_host = iter(timer.model.host_ns_batch(batch).tolist())
    kernel_device = iter((timer.slowdown * timer.model.device_ns(batch)).tolist())
    host: list[float] = []
    device: list[float] = []
    waits: list[int] = []
    for piece in pieces:
        for _ in piece.collectives:
            host.append(c.host_time_factor * (c.collective_host_overhead_ns or c.host_overhead_ns))
            device.append(next(comm_ns))
        for _ in piece.kernels:
            host.append(next(kernel_host))
            device.append(next(kernel_device))
        if piece.wait:
            waits.append(len(host))
    h, d = np.array(host), np.array(device)
    if timer.device.host_runs_kernels:  # the CPU runs each op itself
        return float(h.sum() + d.sum())
    cuts = sorted({w for w in waits if 0 < w < len(h)})
    parts = split_times(h, d, Segment(block=0, phase=Phase.OPTIMIZER, start=0, stop=len(h), count=1), cuts)
    return drained_ns(parts)


def gc_host_factor(training: TrainingSpec) -> float:
    """Factor on the per-kernel host costs: without the automatic collector's share under --manual-gc."""
    return 1.0 - GC_HOST_SHARE if training.manual_gc else 1.0


def gc_step_ns(training: TrainingSpec, host_time_factor: float) -> float:
    """Host time per step of --manual-gc-interval's full collections, amortised."""
    if not (training.manual_gc and training.manual_gc_interval):
        return 0.0
    return host_time_factor * FULL_COLLECT_NS / training.manual_gc_interval
