"""A schedule's tasks as flat arrays in dependency-level order, built once per schedule shape.

The compute streams of :mod:`vtrain_plugin.sim.engine` obey one recurrence: a task ends at
``max(end of the rank's previous task, end of its dependency + that send) + its duration``, where
the dependency of a forward of virtual stage ``s > 0`` is the forward of ``s - 1`` (same
micro-batch, plus the activation send of ``s - 1``) and that of a backward of ``s < last`` is the
backward of ``s + 1`` (plus the gradient send of ``s + 1``). The level of a task is one more than the
larger level of its two predecessors; all tasks of one level are independent of each other, so the
array engine (:mod:`vtrain_plugin.sim.array_engine`) evaluates a whole level with a few array
operations. Each rank holds at most one task per level, so a level has at most ``pp`` tasks.

Nothing here depends on durations: a :class:`TaskGraph` is cached per (schedule kind, pp, v, m),
in the process and on disk beside the trace cache (``<cache dir>/task_graphs``, keyed by the source
of this module and of the schedules), so every plan, search worker and run of that shape shares one
build: building walks every task in Python (~0.2 s CPU at pp 105 and 480 micro-batches), reading
the stored arrays back ~6 ms.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from vtrain_plugin.capture import disk_cache
from vtrain_plugin.core.files import atomic_write_bytes
from vtrain_plugin.sim.schedules import TaskKind, build_schedule
from vtrain_plugin.specs.training import ScheduleKind

log = logging.getLogger(__name__)


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
    """The task graph of this schedule shape: this process's, else the disk cache's, else built (and stored)."""
    key = (ScheduleKind(kind).value, pipeline_parallel, virtual_pipeline, num_microbatches, microbatch_group_size)
    if 2 * pipeline_parallel * virtual_pipeline * num_microbatches < _DISK_MIN_TASKS or not disk_cache.enabled():
        return build_task_graph(*key)
    path = _entry_path(key)
    graph = _read(path, key)
    if graph is None:
        graph = build_task_graph(*key)
        _store(path, key, graph)
    return graph


def build_task_graph(kind: ScheduleKind, pipeline_parallel: int, virtual_pipeline: int, num_microbatches: int,
                     microbatch_group_size: int | None = None) -> TaskGraph:
    """The task graph built from the schedule's tasks (:func:`task_graph` caches it)."""
    pp, m = pipeline_parallel, num_microbatches
    tasks = build_schedule(kind, pp, virtual_pipeline, m, microbatch_group_size).tasks
    stages = pp * virtual_pipeline
    # Tasks in rank-major order first, as arrays: the loops below are array operations, not per task.
    flat = [task for rank_tasks in tasks for task in rank_tasks]
    n = len(flat)
    counts = [len(rank_tasks) for rank_tasks in tasks]
    rank_of = np.repeat(np.arange(pp, dtype=np.intp), counts)
    forward_of = np.fromiter((task.kind is TaskKind.FORWARD for task in flat), dtype=bool, count=n)
    mb_of = np.fromiter((task.microbatch for task in flat), dtype=np.intp, count=n)
    stage_of = np.fromiter((task.chunk for task in flat), dtype=np.intp, count=n) * pp + rank_of
    first_of_rank = np.zeros(n, dtype=bool)
    first_of_rank[np.cumsum([0, *counts[:-1]])[np.asarray(counts) > 0]] = True
    prev_of = np.where(first_of_rank, -1, np.arange(n, dtype=np.intp) - 1)
    # (stage, microbatch, is_forward) -> task id
    ids = np.full((stages, m, 2), -1, dtype=np.intp)
    ids[stage_of, mb_of, forward_of.astype(np.intp)] = np.arange(n, dtype=np.intp)
    send_of = _send_stage(stage_of, forward_of, stages)
    dep_of = np.where(send_of < stages, ids[np.minimum(send_of, stages - 1), mb_of, forward_of.astype(np.intp)], -1)
    level = np.asarray(_levels(prev_of.tolist(), dep_of.tolist(), tasks), dtype=np.intp)
    order = np.lexsort((rank_of, level))  # by level, then rank (stable: the sort of (level, rank) pairs)
    new = np.empty(n, dtype=np.intp)
    new[order] = np.arange(n, dtype=np.intp)

    def remap(old: np.ndarray) -> np.ndarray:
        picked = old[order]
        return np.where(picked >= 0, new[np.maximum(picked, 0)], n)

    levels = level[order]
    starts = [0, *(np.flatnonzero(levels[1:] != levels[:-1]) + 1).tolist(), n]
    steady = _steady_state(order, level, prev_of, dep_of, rank_of, stage_of, forward_of, starts,
                           max_period=2 * stages)
    last_task = np.zeros(pp, dtype=np.intp)
    has_tasks = np.asarray(counts) > 0
    last_task[has_tasks] = new[(np.cumsum(counts) - 1)[has_tasks]]  # in rank-major execution order
    latest = np.full(stages, -1, dtype=np.intp)  # per virtual stage, its last backward in that order
    np.maximum.at(latest, stage_of[~forward_of], np.flatnonzero(~forward_of))
    last_backward = np.where(latest >= 0, new[np.maximum(latest, 0)], n)
    return TaskGraph(
        num_tasks=n, num_stages=stages, pipeline_parallel=pp,
        rank=rank_of[order], stage=stage_of[order], is_forward=forward_of[order],
        prev=remap(prev_of), dep=remap(dep_of), send_stage=send_of[order],
        level_starts=tuple(starts), last_task=last_task, last_backward=last_backward,
        first_forward=new[ids[:, 0, 1]], steady=steady)


def _send_stage(stage: np.ndarray, is_forward: np.ndarray, stages: int) -> np.ndarray:
    """Per task, the virtual stage whose send its dependency waits for (``stages``: none): a forward
    waits on the forward of the stage before, a backward on the backward of the stage after."""
    after = is_forward & (stage > 0)
    before = ~is_forward & (stage < stages - 1)
    return np.where(after, stage - 1, np.where(before, stage + 1, stages))


# The on-disk entries: one file per schedule shape, a JSON header line (its own key: shape, entry
# format, digest of the code that builds it; the stored arrays' lengths) and the arrays, int32, one
# zlib stream: one read and one inflate (a zip of arrays, .npz, costs ~2 ms to open whatever its size).
# What follows from other arrays (rank, send stage) is not stored.
_ENTRY_FORMAT = 1
SUFFIX = ".graph.z"
# Smaller graphs are built, not stored: a read costs ~0.5 ms CPU however small the graph, a build of
# 512 tasks (1F1B, pp 4, 64 micro-batches) ~1.6 ms, of 100,800 (pp 105, 480) ~230 ms against a 6 ms read.
_DISK_MIN_TASKS = 512
_BUILT_BY = ("vtrain_plugin/sim/task_graph.py", "vtrain_plugin/sim/schedules.py", "vtrain_plugin/specs/training.py")
_REPO = Path(__file__).resolve().parents[2]
_STORED = ("stage", "is_forward", "prev", "dep", "last_task", "last_backward", "first_forward")


def task_graphs_dir() -> Path:
    return disk_cache.cache_dir() / "task_graphs"


@lru_cache(maxsize=1)
def _code_digest() -> str:
    digest = hashlib.sha256()
    for name in _BUILT_BY:
        digest.update(name.encode() + b"\0" + (_REPO / name).read_bytes() + b"\0")
    return digest.hexdigest()


def _entry_key(key: tuple) -> dict:
    return {"shape": list(key), "format": _ENTRY_FORMAT, "code": _code_digest(),
            "python": disk_cache.versions()["python"]}


def _entry_path(key: tuple) -> Path:
    name = json.dumps(_entry_key(key), sort_keys=True)
    return task_graphs_dir() / f"{hashlib.sha256(name.encode()).hexdigest()}{SUFFIX}"


def _read(path: Path, key: tuple) -> TaskGraph | None:
    """The stored graph at ``path`` if it holds ``key``'s; None (with a debug log) when absent,
    of another key, or unreadable (then it is built again and overwritten)."""
    try:
        header, _, payload = path.read_bytes().partition(b"\n")
        meta = json.loads(header)
        if meta.get("key") != _entry_key(key):
            log.debug("task-graph cache: ignoring %s, an entry of another key", path)
            return None
        flat = np.frombuffer(zlib.decompress(payload), dtype=np.int32).astype(np.intp)
        lengths = meta["lengths"]
        if len(lengths) != len(_STORED) + 2 or sum(lengths) != len(flat):
            raise ValueError(f"{len(flat)} values for lengths {lengths}")
        parts = dict(zip((*_STORED, "level_starts", "steady"), np.split(flat, np.cumsum(lengths)[:-1]), strict=True))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zlib.error) as exc:
        log.debug("task-graph cache: ignoring %s (%s: %s)", path, type(exc).__name__, exc)
        return None
    disk_cache.touch(path)
    pp, stages = key[1], key[1] * key[2]
    stage, is_forward = parts.pop("stage"), parts.pop("is_forward").astype(bool)
    level_starts, steady = parts.pop("level_starts"), parts.pop("steady")
    return TaskGraph(num_tasks=len(stage), num_stages=stages, pipeline_parallel=pp, rank=stage % pp, stage=stage,
                     is_forward=is_forward, send_stage=_send_stage(stage, is_forward, stages),
                     level_starts=tuple(level_starts.tolist()),
                     steady=SteadyState(*steady.tolist()) if len(steady) else None, **parts)


def _store(path: Path, key: tuple, graph: TaskGraph) -> None:
    """Write ``graph`` (atomically) and keep the folder within the trace cache's size limit; a cache
    that cannot be written is a warning: the graph itself was built."""
    steady = graph.steady
    arrays = [getattr(graph, name) for name in _STORED]
    arrays += [np.asarray(graph.level_starts, dtype=np.intp),
               np.asarray([] if steady is None else [steady.period, steady.first, steady.stop, steady.lookback],
                          dtype=np.intp)]
    header = json.dumps({"key": _entry_key(key), "lengths": [len(x) for x in arrays]}, sort_keys=True)
    payload = zlib.compress(np.concatenate(arrays).astype(np.int32).tobytes(), 1)  # level 6: 7x the CPU, 1% smaller
    try:
        atomic_write_bytes(path, header.encode() + b"\n" + payload)
        disk_cache.prune(path.parent, disk_cache.max_bytes(), suffix=SUFFIX)
    except OSError as exc:
        log.warning("task-graph cache: could not write %s (%s); continuing without it", path, exc)


_MIN_REPEATS = 4  # a repeating stretch shorter than this many periods is not worth detecting


def _steady_state(order: np.ndarray, level: np.ndarray, prev_of: np.ndarray, dep_of: np.ndarray,
                  rank_of: np.ndarray, stage_of: np.ndarray, forward_of: np.ndarray, starts: list[int], *,
                  max_period: int) -> SteadyState | None:
    """The longest stretch of levels that repeats with some period (the steady 1F1B phase), if any.

    Periods up to ``max_period`` levels are searched: one forward and one backward of every virtual
    stage on every rank (``2 * pp * vp``) is the longest period of Megatron's schedules, and a search
    over all periods would grow with the square of the micro-batches. The steady state only saves
    simulation work (each repeat is checked against the simulated end times before it is used), so a
    schedule whose period were longer would be simulated in full, with the same result.
    """
    def delta(other: np.ndarray) -> np.ndarray:  # levels back to a predecessor, -1 for none
        return np.where(other >= 0, level - level[np.maximum(other, 0)], -1)

    # Level k's shape: (rank, stage, is_forward, levels back to prev, to dep) of its tasks, in order.
    back_prev, back_dep = delta(prev_of), delta(dep_of)
    rows = np.stack([rank_of, stage_of, forward_of, back_prev, back_dep], axis=1).astype(np.int64)[order]
    num_levels = len(starts) - 1
    ids: dict[bytes, int] = {}
    signature = np.array([ids.setdefault(rows[starts[k]:starts[k + 1]].tobytes(), len(ids))
                          for k in range(num_levels)])
    lookback = np.maximum.reduceat(np.maximum(back_prev, back_dep)[order], starts[:-1]).astype(np.intp)
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
