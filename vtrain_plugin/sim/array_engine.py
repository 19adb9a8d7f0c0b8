"""The compute streams of all pipeline ranks, evaluated a dependency level at a time with numpy.

Same recurrence and results as the event engine's compute phase (:func:`vtrain_plugin.sim.engine`),
which stays the reference and the one that records timelines: a task ends at
``max(previous task's end, dependency's end + send) + duration`` (see
:mod:`vtrain_plugin.sim.task_graph`). A level's tasks are independent, so each level is five array
operations over at most ``pp`` tasks instead of a Python step per task; the waiting time and the
last backward's start follow from the end times in one pass over all tasks.
"""

from __future__ import annotations

from collections import OrderedDict
from operator import attrgetter

import numpy as np

from vtrain_plugin.cost.work import PipelineWork
from vtrain_plugin.sim.task_graph import SteadyState, task_graph


# what the compute streams read of a chunk, in the order _run_compute unpacks it
_DURATIONS = attrgetter("forward_ns", "recompute_ns", "backward_ns", "p2p_forward_ns", "p2p_backward_ns")
_RESULTS_CACHE_SIZE = 256
# run_compute's results by everything they depend on: the schedule's shape, the chunks' compute and
# send durations and the gates. Plans of a search that differ only in what happens beside the
# compute streams (gradient reduction, optimizer step) share them.
_results: OrderedDict[tuple, tuple[tuple[float, ...], ...]] = OrderedDict()


def run_compute(work: PipelineWork, gates: list[float] | None = None
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(end of each rank's last task, start of each virtual stage's last backward compute, each
    rank's time waiting on in-flight sends, each rank's time waiting on parameter all-gathers), as
    the event engine computes them. ``gates[s]``: the earliest end of virtual stage ``s``'s first
    forward (its parameters' all-gathers, see :func:`vtrain_plugin.sim.engine.simulate`)."""
    chunks = work.chunks
    durations = tuple(map(_DURATIONS, chunks))
    key = (work.schedule, work.pipeline_parallel, work.virtual_pipeline, work.num_microbatches,
           work.microbatch_group_size, durations, None if gates is None else tuple(gates))
    hit = _results.get(key)
    if hit is None:
        hit = _results[key] = tuple(tuple(r) for r in _run_compute(work, durations, gates))
        if len(_results) > _RESULTS_CACHE_SIZE:
            _results.popitem(last=False)
    else:
        _results.move_to_end(key)
    return tuple(list(r) for r in hit)  # fresh lists: the caller's to change


def _run_compute(work: PipelineWork, durations: tuple[tuple[float, ...], ...], gates: list[float] | None
                 ) -> tuple[list[float], list[float], list[float], list[float]]:
    graph = task_graph(work.schedule, work.pipeline_parallel, work.virtual_pipeline, work.num_microbatches,
                       work.microbatch_group_size)
    forward, recompute, backward, p2p_forward, p2p_backward = (
        np.array([d[i] for d in durations]) for i in range(5))
    # Indexed by virtual stage; the extra last entry is the "no send" sentinel.
    sends = np.append(p2p_forward, 0.0)
    sends_back = np.append(p2p_backward, 0.0)

    stage, is_forward = graph.stage, graph.is_forward
    duration = np.where(is_forward, forward[stage], recompute[stage] + backward[stage])
    send = np.where(is_forward, sends[graph.send_stage], sends_back[graph.send_stage])
    end = np.zeros(graph.num_tasks + 1)  # the sentinel task ends at 0
    floor = None
    if gates is not None:  # only micro-batch 0 tasks, before any steady state: see _periodic_cycle
        floor = np.zeros(graph.num_tasks + 1)
        floor[graph.first_forward] = gates
    prev, dep = graph.prev, graph.dep
    starts = graph.level_starts
    steady = graph.steady
    check_from = steady.first + steady.lookback - 1 + steady.period if steady else len(starts)
    k = 0
    while k < len(starts) - 1:
        a, b = starts[k], starts[k + 1]
        ready = end[dep[a:b]]
        ready += send[a:b]
        np.maximum(ready, end[prev[a:b]], out=ready)
        ready += duration[a:b]
        if floor is not None:
            np.maximum(ready, floor[a:b], out=ready)
        end[a:b] = ready
        if check_from <= k < steady.stop - 1 and (k - check_from) % _CHECK_EVERY == 0:
            cycle = _periodic_cycle(end, starts, k, steady, max_cycle=2 * graph.num_stages)
            if cycle is not None:
                _repeat_cycle(end, starts, k, steady, *cycle)
                k = steady.stop
                continue
        k += 1

    free = end[prev]
    ready = end[dep] + send
    wait = np.minimum(np.maximum(ready - free, 0.0), send)
    pp_wait = np.bincount(graph.rank, weights=wait, minlength=graph.pipeline_parallel)
    start = np.maximum(free, ready)
    first = graph.first_forward
    held = end[first] - (start[first] + duration[first]) if gates is not None else np.zeros(len(first))
    gate_wait = np.bincount(graph.rank[first], weights=held, minlength=graph.pipeline_parallel)
    last = graph.last_backward
    last_backward_start = np.where(last < graph.num_tasks, start[np.minimum(last, graph.num_tasks - 1)]
                                   + recompute, 0.0)
    return end[graph.last_task].tolist(), last_backward_start.tolist(), pp_wait.tolist(), gate_wait.tolist()


# Two end times count as the same shift when they differ by less than this share of the larger:
# a few units in the last place of sums of thousands of durations, far below the 1e-9 agreement
# with the event engine that the tests require.
_SHIFT_TOLERANCE = 1e-12
_CHECK_EVERY = 8  # levels between two looks for a periodic steady state


def _periodic_cycle(end: np.ndarray, starts: tuple[int, ...], k: int, steady: SteadyState,
                    max_cycle: int) -> tuple[int, float] | None:
    """(levels per cycle, shift) when every task of the last ``lookback`` levels ends exactly
    ``shift`` later than its counterpart one cycle (a whole number of periods, at most
    ``max_cycle``) earlier; else None.

    Then the steady state has become periodic: every later level of the stretch is computed from
    shifted copies of these levels by the same operations, so it is its counterpart shifted too
    (max and + commute with adding a constant). With identical middle stages the cycle is often
    many periods long (a delay travels through them one rank per period), hence the search over
    cycle lengths, all at once. The search stops at ``max_cycle`` periods (twice the virtual stages,
    the longest way a delay travels): a search up to the current level would grow with the square
    of the micro-batches in schedules that never become periodic (GPipe with uneven stages, whose
    first stages run ahead of a slower one), and a longer cycle is simulated in full, with the
    same result.
    """
    per_period = starts[steady.first + steady.period] - starts[steady.first]
    lo, hi = starts[k - steady.lookback + 1], starts[k + 1]
    cycles = min((lo - starts[steady.first]) // per_period, max_cycle)
    if cycles < 1:
        return None
    back = per_period * np.arange(1, cycles + 1)
    window = np.arange(lo, hi)
    shifts = end[window] - end[window[None, :] - back[:, None]]  # one row per cycle length
    tolerance = _SHIFT_TOLERANCE * abs(float(end[hi - 1]))
    uniform = np.flatnonzero(np.ptp(shifts, axis=1) <= tolerance)
    if not len(uniform):
        return None
    c = int(uniform[0])
    return (c + 1) * steady.period, float(shifts[c, 0])


def _repeat_cycle(end: np.ndarray, starts: tuple[int, ...], k: int, steady: SteadyState, cycle: int,
                  shift: float) -> None:
    """Fill levels ``k + 1 .. stop - 1``: each is its counterpart among the last cycle's levels,
    ``n`` cycles back, plus ``n`` shifts."""
    level_start = np.asarray(starts)
    levels = np.arange(k + 1, steady.stop)
    cycles = (levels - k + cycle - 1) // cycle
    counts = level_start[levels + 1] - level_start[levels]
    offset = level_start[levels] - level_start[levels - cycles * cycle]
    tasks = np.arange(level_start[k + 1], level_start[steady.stop])
    end[tasks] = end[tasks - np.repeat(offset, counts)] + np.repeat(cycles, counts) * shift
