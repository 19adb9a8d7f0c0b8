"""A schedule's tasks as flat arrays in dependency-level order, built once per schedule shape.

The compute streams of :mod:`vtrain_plugin.sim.engine` obey one recurrence: a task ends at
``max(end of the rank's previous task, end of its dependency + that send) + its duration``, where
the dependency of a forward of virtual stage ``s > 0`` is the forward of ``s - 1`` (same
micro-batch, plus the activation send of ``s - 1``) and that of a backward of ``s < last`` is the
backward of ``s + 1`` (plus the gradient send of ``s + 1``). The level of a task is one more than the
larger level of its two predecessors; all tasks of one level are independent of each other, so the
array engine (:mod:`vtrain_plugin.sim.array_engine`) evaluates a whole level with a few array
operations. Each rank holds at most one task per level, so a level has at most ``pp`` tasks.

Nothing here depends on durations: a :class:`TaskGraph` is cached per (schedule kind, pp, v, m)
and shared by every plan of that shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from vtrain_plugin.sim.schedules import TaskKind, build_schedule
from vtrain_plugin.specs.training import ScheduleKind


@dataclass(frozen=True, slots=True, eq=False)
class TaskGraph:
    """Tasks in level order (index ``n`` is a sentinel: end time 0, send 0).

    ``prev`` is the rank's previous task, ``dep`` the cross-stage dependency, ``send_stage`` the
    virtual stage whose send the dependency waits for (the sentinel ``num_stages`` where none).
    """

    num_tasks: int
    num_stages: int
    pipeline_parallel: int
    rank: np.ndarray  # int, per task
    stage: np.ndarray  # virtual stage chunk * pp + rank
    is_forward: np.ndarray  # bool
    prev: np.ndarray  # task index, or num_tasks
    dep: np.ndarray  # task index, or num_tasks
    send_stage: np.ndarray  # virtual stage index, or num_stages
    level_starts: tuple[int, ...]  # level k holds tasks level_starts[k]:level_starts[k + 1]
    last_task: np.ndarray  # per rank, its last task
    last_backward: np.ndarray  # per virtual stage, its last backward in execution order
    first_forward: np.ndarray  # per virtual stage, its forward of micro-batch 0
    steady: SteadyState | None  # a stretch of levels that repeats (None: none long enough)


@dataclass(frozen=True, slots=True)
class SteadyState:
    """Levels ``first .. stop - 1`` repeat with ``period``: level ``j >= first + period`` has the
    tasks of level ``j - period`` (same ranks, stages and kinds, predecessors ``period`` levels
    later), one micro-batch on. No task reaches back more than ``lookback`` levels."""

    period: int
    first: int
    stop: int
    lookback: int


@lru_cache(maxsize=512)
def task_graph(kind: ScheduleKind, pipeline_parallel: int, virtual_pipeline: int, num_microbatches: int,
               microbatch_group_size: int | None = None) -> TaskGraph:
    pp, m = pipeline_parallel, num_microbatches
    tasks = build_schedule(kind, pp, virtual_pipeline, m, microbatch_group_size).tasks
    stages = pp * virtual_pipeline
    # Task ids in rank-major order first; (stage, microbatch, is_forward) -> id.
    ids: dict[tuple[int, int, bool], int] = {}
    rank_of, stage_of, forward_of, prev_of, mb_of = [], [], [], [], []
    for r, rank_tasks in enumerate(tasks):
        for i, task in enumerate(rank_tasks):
            s = task.chunk * pp + r
            forward = task.kind is TaskKind.FORWARD
            ids[s, task.microbatch, forward] = len(rank_of)
            rank_of.append(r)
            stage_of.append(s)
            forward_of.append(forward)
            mb_of.append(task.microbatch)
            prev_of.append(len(rank_of) - 2 if i else -1)
    n = len(rank_of)
    dep_of, send_of = [], []
    for t in range(n):
        s, forward = stage_of[t], forward_of[t]
        mb = mb_of[t]
        if forward and s:
            dep_of.append(ids[s - 1, mb, True])
            send_of.append(s - 1)
        elif not forward and s < stages - 1:
            dep_of.append(ids[s + 1, mb, False])
            send_of.append(s + 1)
        else:
            dep_of.append(-1)
            send_of.append(stages)
    level = _levels(prev_of, dep_of, tasks)
    order = sorted(range(n), key=lambda t: (level[t], rank_of[t]))
    new = [0] * n
    for position, t in enumerate(order):
        new[t] = position

    def remap(old: list[int]) -> np.ndarray:
        return np.array([new[old[t]] if old[t] >= 0 else n for t in order], dtype=np.intp)

    levels = [level[t] for t in order]
    starts = [0] + [i for i in range(1, n) if levels[i] != levels[i - 1]] + [n]
    steady = _steady_state(order, level, prev_of, dep_of, rank_of, stage_of, forward_of, len(starts) - 1,
                           max_period=2 * stages)
    last_task = np.zeros(pp, dtype=np.intp)
    last_backward = np.full(stages, n, dtype=np.intp)
    for t in range(n):  # rank-major execution order: later tasks overwrite earlier ones
        last_task[rank_of[t]] = new[t]
        if not forward_of[t]:
            last_backward[stage_of[t]] = new[t]
    return TaskGraph(
        num_tasks=n, num_stages=stages, pipeline_parallel=pp,
        rank=np.array([rank_of[t] for t in order], dtype=np.intp),
        stage=np.array([stage_of[t] for t in order], dtype=np.intp),
        is_forward=np.array([forward_of[t] for t in order], dtype=bool),
        prev=remap(prev_of), dep=remap(dep_of),
        send_stage=np.array([send_of[t] for t in order], dtype=np.intp),
        level_starts=tuple(starts), last_task=last_task, last_backward=last_backward,
        first_forward=np.array([new[ids[stage, 0, True]] for stage in range(stages)], dtype=np.intp), steady=steady)


_MIN_REPEATS = 4  # a repeating stretch shorter than this many periods is not worth detecting


def _steady_state(order: list[int], level: list[int], prev_of: list[int], dep_of: list[int], rank_of: list[int],
                  stage_of: list[int], forward_of: list[bool], num_levels: int, *,
                  max_period: int) -> SteadyState | None:
    """The longest stretch of levels that repeats with some period (the steady 1F1B phase), if any.

    Periods up to ``max_period`` levels are searched: one forward and one backward of every virtual
    stage on every rank (``2 * pp * vp``) is the longest period of Megatron's schedules, and a search
    over all periods would grow with the square of the micro-batches. The steady state only saves
    simulation work (each repeat is checked against the simulated end times before it is used), so a
    schedule whose period were longer would be simulated in full, with the same result.
    """
    def delta(t: int, other: int) -> int:
        return level[t] - level[other] if other >= 0 else -1

    shapes: dict[int, list] = {}
    for t in order:
        shapes.setdefault(level[t], []).append(
            (rank_of[t], stage_of[t], forward_of[t], delta(t, prev_of[t]), delta(t, dep_of[t])))
    ids: dict[tuple, int] = {}
    signature = np.array([ids.setdefault(tuple(shapes[k]), len(ids)) for k in range(num_levels)])
    lookback = np.zeros(num_levels, dtype=np.intp)
    for k, tasks in shapes.items():
        lookback[k] = max(max(p, d) for _, _, _, p, d in tasks)
    best: SteadyState | None = None
    best_saved = 0
    for period in range(1, min(num_levels // _MIN_REPEATS, max_period) + 1):
        same = np.concatenate(([False], signature[period:] == signature[:-period], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for begin, end in zip(edges[::2], edges[1::2]):  # levels begin+period .. end+period-1 match
            first, stop = int(begin), int(end) + period
            span = stop - first
            if span < _MIN_REPEATS * period or span - 2 * period <= best_saved:
                continue
            reach = int(lookback[first:stop].max())
            best_saved = span - 2 * period
            best = SteadyState(period=period, first=first, stop=stop, lookback=max(reach, 1))
    return best


def _levels(prev_of: list[int], dep_of: list[int], tasks) -> list[int]:
    """Dependency level of every task, walking ranks in turn as far as their dependencies are known
    (the engine's order); a schedule whose tasks wait on each other in a cycle is reported."""
    n = len(prev_of)
    level = [-1] * n
    offsets = [0]
    for rank_tasks in tasks:
        offsets.append(offsets[-1] + len(rank_tasks))
    position = offsets[:-1]
    remaining = n
    while remaining:
        progressed = 0
        for r in range(len(tasks)):
            t = position[r]
            while t < offsets[r + 1]:
                d = dep_of[t]
                if d >= 0 and level[d] < 0:
                    break
                p = prev_of[t]
                level[t] = 1 + max(level[p] if p >= 0 else -1, level[d] if d >= 0 else -1)
                t += 1
            progressed += t - position[r]
            position[r] = t
        if not progressed:
            raise RuntimeError(f"schedule deadlocked with {remaining} tasks left")
        remaining -= progressed
    return level
