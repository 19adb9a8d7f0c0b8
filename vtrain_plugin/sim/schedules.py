"""Pipeline schedules: the order in which each pipeline rank runs its forward and backward passes.

Builders are registered by :class:`ScheduleKind` and give one rank's task list; the orders follow
megatron-core 0.16 (``forward_backward_pipelining_without_interleaving`` and
``..._with_interleaving``, whose micro-batch groups are ``microbatch_group_size_per_vp_stage``,
``pp`` by default). Schedules are immutable and cached, so a sweep builds each shape once; what
memory reads of one (:class:`Occupancy`) follows from its shape without building it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

import numpy as np

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.registry import Registry
from vtrain_plugin.specs.training import ScheduleKind, check_schedule


class TaskKind(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    kind: TaskKind
    chunk: int  # model chunk on this rank; virtual stage = chunk * pp + pipeline_rank
    microbatch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Occupancy:
    """What a schedule's ranks hold at their peaks: what memory reads of a schedule, known from its
    shape without its task lists (:func:`schedule_occupancy`)."""

    virtual_pipeline: int
    peak_inflight_per_rank: tuple[int, ...]  # see peak_inflight
    # Per rank with several chunks: each task's chunk and +1 (forward) / -1 (backward), for peak_live.
    task_walks: tuple[tuple[np.ndarray, np.ndarray], ...] = field(default=(), compare=False, repr=False)

    def peak_inflight(self, pipeline_rank: int) -> int:
        """Most (chunk, micro-batch) pairs whose activations rank ``pipeline_rank`` holds at once.

        A forward stores its chunk's activations until the matching backward frees them; the peak
        is taken right after a forward (GPipe: m, 1F1B: min(pp - rank, m), interleaved:
        min((pp - rank - 1) * 2 + (v - 1) * pp + 1, m * v)): the warm-up forwards and the first
        forward of the steady phase, or every forward when there is no steady phase.
        """
        return self.peak_inflight_per_rank[pipeline_rank]

    def peak_live(self, pipeline_rank: int, chunk_nbytes: Sequence[int],
                  rise_nbytes: Sequence[int] = ()) -> tuple[int, int]:
        """(Most bytes rank ``pipeline_rank`` holds at once, the (chunk, micro-batch) pairs it holds
        then), for chunks whose forward keeps ``chunk_nbytes[c]`` each until their backward, and
        whose backward rises ``rise_nbytes[c]`` above the level it starts from (none: 0): the
        walk of its task order, each forward's level after it and each backward's at its start plus
        its rise; or :meth:`peak_inflight` times the size plus the rise when its chunks are alike
        (1F1B and GPipe run a backward at their peak level)."""
        rises = tuple(rise_nbytes) or (0,) * len(chunk_nbytes)
        if len(set(zip(chunk_nbytes, rises))) <= 1:
            return self.peak_inflight(pipeline_rank) * (chunk_nbytes[0] if chunk_nbytes else 0) + \
                (rises[0] if rises else 0), self.peak_inflight(pipeline_rank)
        chunks, sign = self.task_walks[pipeline_rank]
        sizes = np.asarray(chunk_nbytes, dtype=np.int64)[chunks]
        live = np.cumsum(sign * sizes)
        backward = sign < 0
        moments = np.where(backward, live + sizes + np.asarray(rises, dtype=np.int64)[chunks], live)
        peak = int(np.argmax(moments))
        return int(moments[peak]), int(np.cumsum(sign)[peak]) + int(backward[peak])

    @property
    def peak_inflight_microbatches(self) -> tuple[float, ...]:
        """Per rank, the peak in units of one micro-batch through all of the rank's chunks.

        For interleaving on rank 0 this is ``pp + (pp - 1) / v``, i.e. Korthikanti et al.'s
        ``pp * (1 + (pp - 1) / (pp * v))``.
        """
        return tuple(peak / self.virtual_pipeline for peak in self.peak_inflight_per_rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    kind: ScheduleKind
    pipeline_parallel: int
    virtual_pipeline: int
    num_microbatches: int
    tasks: tuple[tuple[Task, ...], ...]  # per pipeline rank, in execution order
    microbatch_group_size: int | None = None  # interleaved: micro-batches per group; None: pp
    occupancy: Occupancy  # what its ranks hold at their peaks

    def peak_inflight(self, pipeline_rank: int) -> int:
        """:meth:`Occupancy.peak_inflight`."""
        return self.occupancy.peak_inflight(pipeline_rank)

    def peak_live(self, pipeline_rank: int, chunk_nbytes: Sequence[int],
                  rise_nbytes: Sequence[int] = ()) -> tuple[int, int]:
        """:meth:`Occupancy.peak_live`."""
        return self.occupancy.peak_live(pipeline_rank, chunk_nbytes, rise_nbytes)

    @property
    def peak_inflight_microbatches(self) -> tuple[float, ...]:
        """:attr:`Occupancy.peak_inflight_microbatches`."""
        return self.occupancy.peak_inflight_microbatches


ScheduleBuilder = Callable[[int, int, int, int, int], list[Task]]
"""``(pipeline_parallel, virtual_pipeline, num_microbatches, pipeline_rank, microbatch_group_size) ->
tasks``; the group size (``pipeline_parallel`` unless given) matters to the interleaved schedule only."""

_BUILDERS: Registry[ScheduleBuilder] = Registry("schedule", plural="schedules")


def register_schedule(kind: ScheduleKind) -> Callable[[ScheduleBuilder], ScheduleBuilder]:
    return _BUILDERS.register(kind)


def schedule_builder(kind: ScheduleKind | str) -> ScheduleBuilder:
    return _BUILDERS.get(kind)


@lru_cache(maxsize=256)
def build_schedule(kind: ScheduleKind | str, pipeline_parallel: int, virtual_pipeline: int,
                   num_microbatches: int, microbatch_group_size: int | None = None) -> Schedule:
    builder = _checked(kind, pipeline_parallel, virtual_pipeline, num_microbatches, microbatch_group_size)
    group = pipeline_parallel if microbatch_group_size is None else microbatch_group_size
    tasks = tuple(tuple(builder(pipeline_parallel, virtual_pipeline, num_microbatches, r, group))
                  for r in range(pipeline_parallel))
    return Schedule(kind=ScheduleKind(kind), pipeline_parallel=pipeline_parallel,
                    virtual_pipeline=virtual_pipeline, num_microbatches=num_microbatches, tasks=tasks,
                    microbatch_group_size=microbatch_group_size,
                    occupancy=schedule_occupancy(kind, pipeline_parallel, virtual_pipeline, num_microbatches,
                                                 microbatch_group_size))


@lru_cache(maxsize=256)
def schedule_occupancy(kind: ScheduleKind | str, pipeline_parallel: int, virtual_pipeline: int,
                       num_microbatches: int, microbatch_group_size: int | None = None) -> Occupancy:
    """The :class:`Occupancy` of :func:`build_schedule`'s schedule, from its shape: each rank runs
    its warm-up forwards, then a forward and a backward in turn, then the remaining backwards, the
    backwards taking the virtual micro-batches in the forwards' order with the chunk mirrored (the
    three builders below). Its memory needs no task list, which is thousands of objects per rank
    for a deep pipeline of many micro-batches."""
    _checked(kind, pipeline_parallel, virtual_pipeline, num_microbatches, microbatch_group_size)
    kind = ScheduleKind(kind)
    pp, vp, m = pipeline_parallel, virtual_pipeline, num_microbatches
    group = pp if microbatch_group_size is None else microbatch_group_size
    total = m * vp
    warmups = [_warmup(kind, pp, vp, m, r, group) for r in range(pp)]
    walks = ()
    if vp > 1:
        forward = np.array([c for _, c in interleaved_table(m, vp, group)], dtype=np.intp)
        walks = tuple(_walk(forward, vp - 1 - forward, w) for w in warmups)
    return Occupancy(virtual_pipeline=vp, peak_inflight_per_rank=tuple(min(w + 1, total) for w in warmups),
                     task_walks=walks)


def _checked(kind: ScheduleKind | str, pp: int, vp: int, m: int, group: int | None) -> ScheduleBuilder:
    """The builder of ``kind``, once the shape is one it can build."""
    builder = schedule_builder(kind)
    v.positive_int("pipeline_parallel", pp)
    v.positive_int("virtual_pipeline", vp)
    v.positive_int("num_microbatches", m)
    check_schedule(ScheduleKind(kind), pp, vp, m, group)
    return builder


def _warmup(kind: ScheduleKind, pp: int, vp: int, m: int, rank: int, group: int) -> int:
    """Forwards rank ``rank`` runs before its first backward."""
    if kind is ScheduleKind.GPIPE:
        return m
    if kind is ScheduleKind.ONE_F_ONE_B:
        return min(pp - rank - 1, m)
    return min((pp - rank - 1) * 2 + (vp - 1) * group, m * vp)


def _walk(forward: np.ndarray, backward: np.ndarray, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """(Chunk, +1 forward / -1 backward) of each task of a rank whose k-th forward and backward run
    chunks ``forward[k]`` and ``backward[k]``, after ``warmup`` forwards."""
    total = len(forward)
    steady = total - warmup
    chunks = np.empty(2 * total, dtype=np.intp)
    sign = np.empty(2 * total, dtype=np.int64)
    chunks[:warmup], sign[:warmup] = forward[:warmup], 1
    chunks[warmup:warmup + 2 * steady:2], sign[warmup:warmup + 2 * steady:2] = forward[warmup:], 1
    chunks[warmup + 1:warmup + 2 * steady:2], sign[warmup + 1:warmup + 2 * steady:2] = backward[:steady], -1
    chunks[warmup + 2 * steady:], sign[warmup + 2 * steady:] = backward[steady:], -1
    return chunks, sign


# Tasks carry no rank, so every rank shares the same immutable instances.
@lru_cache(maxsize=1 << 16)
def _forward(chunk: int, microbatch: int) -> Task:
    return Task(kind=TaskKind.FORWARD, chunk=chunk, microbatch=microbatch)


@lru_cache(maxsize=1 << 16)
def _backward(chunk: int, microbatch: int) -> Task:
    return Task(kind=TaskKind.BACKWARD, chunk=chunk, microbatch=microbatch)


@register_schedule(ScheduleKind.GPIPE)
def _gpipe(pp: int, vp: int, m: int, rank: int, group: int) -> list[Task]:
    """All forwards, then all backwards in micro-batch order (torch.distributed.pipelining's GPipe)."""
    return [_forward(0, i) for i in range(m)] + [_backward(0, i) for i in range(m)]


@register_schedule(ScheduleKind.ONE_F_ONE_B)
def _one_f_one_b(pp: int, vp: int, m: int, rank: int, group: int) -> list[Task]:
    """Megatron's non-interleaved 1F1B: pp - rank - 1 warm-up forwards, steady 1F1B, cool-down."""
    warmup = _warmup(ScheduleKind.ONE_F_ONE_B, pp, vp, m, rank, group)
    tasks = [_forward(0, i) for i in range(warmup)]
    for i in range(m - warmup):
        tasks += [_forward(0, warmup + i), _backward(0, i)]
    tasks += [_backward(0, i) for i in range(m - warmup, m)]
    return tasks


@register_schedule(ScheduleKind.INTERLEAVED_1F1B)
def _interleaved(pp: int, vp: int, m: int, rank: int, group: int) -> list[Task]:
    """Megatron's interleaved 1F1B.

    Virtual micro-batch k runs (micro-batch, chunk) = table[k] (:func:`interleaved_table`);
    backwards walk the same table with the chunk mirrored (v - 1 - chunk). Warm-up:
    (pp - rank - 1) * 2 + (v - 1) * group forwards.
    """
    table = interleaved_table(m, vp, group)
    total = m * vp
    warmup = _warmup(ScheduleKind.INTERLEAVED_1F1B, pp, vp, m, rank, group)

    def forward(k: int) -> Task:
        mb, c = table[k]
        return _forward(c, mb)

    def backward(k: int) -> Task:
        mb, c = table[k]
        return _backward(vp - 1 - c, mb)

    tasks = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        tasks += [forward(warmup + k), backward(k)]
    tasks += [backward(k) for k in range(total - warmup, total)]
    return tasks


def interleaved_table(num_microbatches: int, virtual_pipeline: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each virtual micro-batch: groups of ``group`` micro-batches walk
    chunk 0, 1, ..., v-1 in turn, the last group taking the remainder (megatron-core's
    ``get_schedule_table``)."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, group):
        stop = num_microbatches if first + group >= num_microbatches else first + group
        table += [(mb, c) for c in range(virtual_pipeline) for mb in range(first, stop)]
    return table
