"""Simulation of one training iteration over the pipeline ranks' streams.

Each pipeline rank runs its schedule's tasks in order on a compute stream. A forward of virtual
stage ``s > 0`` waits for the forward of ``s - 1`` plus that stage's activation send; a backward of
``s < last`` waits for the backward of ``s + 1`` plus its gradient send; recompute runs right before
its backward. Sends do not occupy the sender's compute stream. Ranks are advanced in turn as far as
their dependencies are known, so the whole run costs O(pp * v * m) with no event heap.

After compute, each rank's data-parallel stream reduces the gradient buckets of its chunks: with
``dp_overlap`` a bucket starts when ready (``ready_fraction`` into its chunk's last backward) and
the stream is free, otherwise all start after the rank's last backward. The tied-embedding
all-reduce then joins the first and the last rank once both have reduced their gradients. Megatron's
optimizer step begins with global reductions (grad norm, found-inf) over all ranks, so every rank
starts its optimizer when the last rank's gradients are ready; the iteration ends when the slowest
optimizer ends.

With the distributed optimizer each rank then all-gathers its parameters, bucket by bucket: after
its optimizer step (the iteration ends when the slowest rank has gathered), or, with
``param_gather_overlap``, at the start of the iteration (the end of the previous step): the
gathers of a rank queue on its DP stream in the order its forwards need them, chunk by chunk, and
the first forward of each chunk cannot pass the point where it needs a bucket (``need_fraction``
of its duration) before that bucket is gathered. This issues every gather as early as Megatron-LM's
``align_param_gather`` does the first chunk's (later chunks' a little earlier than Megatron does).

Per-rank breakdowns partition the iteration time: compute (TP collectives, and the MoE layers' EP
collectives, split out by the chunks' shares, proportionally over backward and recompute), exposed
PP comm (waiting for a send after its producer finished), exposed DP comm (gradients not reduced
when compute ends, parameters not gathered when needed or gathered after the optimizer step, and
FSDP's per-layer collectives not hidden behind the layers, the chunks' ``dp_comm`` shares),
embedding sync,
optimizer, and bubble (every other idle time: pipeline fill and drain, waiting for other ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from vtrain_plugin.sim import array_engine
from vtrain_plugin.sim.schedules import Task, TaskKind, build_schedule
from vtrain_plugin.sim.timeline import Interval, IntervalKind, Stream, Timeline
from vtrain_plugin.cost.work import ChunkWork, PipelineWork


BREAKDOWN_FIELDS = ("forward", "backward", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm",
                    "embedding_sync", "optimizer", "bubble")  # RankBreakdown's ``<name>_ns`` fields


class RankBreakdown(NamedTuple):
    """One pipeline rank's share of the iteration, fields in :data:`BREAKDOWN_FIELDS`' order: a
    named tuple, as a simulation makes one per rank and the summary reads each as a row."""

    forward_ns: float
    backward_ns: float
    recompute_ns: float
    tp_comm_ns: float
    cp_comm_ns: float  # exposed context-parallel attention communication (ring steps, K/V all-gathers)
    ep_comm_ns: float  # MoE dispatch and combine collectives (EP, expert TP)
    pp_comm_ns: float
    dp_comm_ns: float
    embedding_sync_ns: float
    optimizer_ns: float
    bubble_ns: float

    @property
    def total_ns(self) -> float:
        return (self.forward_ns + self.backward_ns + self.recompute_ns + self.tp_comm_ns + self.cp_comm_ns
                + self.ep_comm_ns + self.pp_comm_ns + self.dp_comm_ns + self.embedding_sync_ns + self.optimizer_ns
                + self.bubble_ns)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    iteration_ns: float
    ranks: tuple[RankBreakdown, ...]  # per pipeline rank; each sums to iteration_ns
    timeline: Timeline | None = None  # only when simulated with record_timeline=True


def simulate(work: PipelineWork, *, record_timeline: bool = False, reference: bool = False) -> SimResult:
    """Simulate one iteration. The compute streams are evaluated level by level with arrays
    (:mod:`vtrain_plugin.sim.array_engine`) unless a timeline is recorded or ``reference`` asks for
    the task-by-task loop below, which the array path is tested against."""
    pp, vp, m = work.pipeline_parallel, work.virtual_pipeline, work.num_microbatches
    chunks = work.chunks
    intervals: list[list[Interval]] | None = [[] for _ in range(pp)] if record_timeline else None

    gathered, gates = _gather_params(work, intervals)
    if intervals is None and not reference:
        compute_end, last_backward_start, pp_wait, gate_wait = array_engine.run_compute(work, gates)
    else:
        schedule = build_schedule(work.schedule, pp, vp, m, work.microbatch_group_size)
        compute_end, last_backward_start, pp_wait, gate_wait = _run_compute(work, schedule.tasks, intervals, gates)

    # What depends on a rank's chunks alone, once per distinct set: the stages of one role share
    # their chunk objects (cost.costing), so a deep pipeline has a handful.
    own = [chunks[r::pp] for r in range(pp)]  # virtual stages r, pp + r, ...: the rank's chunks in order
    by_chunks: dict[tuple[int, ...], tuple] = {}
    shares = []
    for r in range(pp):
        key = tuple(map(id, own[r]))
        got = by_chunks.get(key)
        if got is None:
            got = by_chunks[key] = _rank_shares(own[r], m)
        shares.append(got)

    grads_ready = [_reduce_gradients(work, r, compute_end[r], last_backward_start, gathered[r], intervals,
                                     shares[r][-1]) for r in range(pp)]
    synced = list(grads_ready)
    ends = {0, pp - 1}  # the ranks of the tied embedding's copies
    if work.embedding_sync_ns:
        start = max(grads_ready[r] for r in ends)
        for r in ends:
            synced[r] = start + work.embedding_sync_ns
            if intervals is not None:
                intervals[r].append(Interval(stream=Stream.DP, kind=IntervalKind.EMBEDDING_SYNC,
                                             label="embedding sync", start_ns=start, end_ns=synced[r]))
    optimizer_start = max(synced)
    after_step = [0.0 if work.param_gather_overlap else shares[r][-2] for r in range(pp)]
    optimizer_ns = work.optimizer_ns
    iteration_ns = optimizer_start + max(t + g for t, g in zip(optimizer_ns, after_step))
    if intervals is not None:
        for r in range(pp):
            step_end = optimizer_start + optimizer_ns[r]
            intervals[r].append(Interval(stream=Stream.COMPUTE, kind=IntervalKind.OPTIMIZER, label="optimizer",
                                         start_ns=optimizer_start, end_ns=step_end))
            if after_step[r]:
                intervals[r].append(Interval(stream=Stream.DP, kind=IntervalKind.DP_COMM, label="param gather",
                                             start_ns=step_end, end_ns=step_end + after_step[r]))

    ranks = []
    for r, (share, ready, end, waited, held, after, step) in enumerate(
            zip(shares, grads_ready, compute_end, pp_wait, gate_wait, after_step, optimizer_ns)):
        forward, backward, recompute, tp, cp, ep, fsdp, computing = share[:8]
        embedding = work.embedding_sync_ns if r in ends else 0.0
        dp = ready - end + held + after + fsdp
        busy = computing + waited + dp + embedding + step
        ranks.append(RankBreakdown(forward, backward, recompute, tp, cp, ep, waited, dp, embedding, step,
                                   max(iteration_ns - busy, 0.0)))
    timeline = None
    if intervals is not None:
        timeline = Timeline(ranks=tuple(tuple(ivs) for ivs in intervals), iteration_ns=iteration_ns)
    return SimResult(iteration_ns=iteration_ns, ranks=tuple(ranks), timeline=timeline)


def _gather_params(work: PipelineWork, intervals: list[list[Interval]] | None
                   ) -> tuple[list[float], list[float] | None]:
    """With ``param_gather_overlap``: when each rank's DP stream has gathered its parameters, and
    the earliest end of each virtual stage's first forward (the gates); else (0, None)."""
    pp = work.pipeline_parallel
    if not work.param_gather_overlap:
        return [0.0] * pp, None
    gates = [0.0] * work.num_virtual_stages
    done = [0.0] * pp
    for r in range(pp):
        for c in range(work.virtual_pipeline):
            s = c * pp + r
            forward = work.chunks[s].forward_ns
            for k, g in enumerate(work.chunks[s].param_gathers):
                start, done[r] = done[r], done[r] + g.comm_ns
                gates[s] = max(gates[s], done[r] + (1.0 - g.need_fraction) * forward)
                if intervals is not None and g.comm_ns:
                    intervals[r].append(Interval(stream=Stream.DP, kind=IntervalKind.DP_COMM,
                                                 label=f"param gather {k} (chunk {c})", start_ns=start,
                                                 end_ns=done[r], chunk=c))
    return done, gates


def _rank_shares(chunks: tuple[ChunkWork, ...], m: int) -> tuple:
    """What a rank running ``chunks`` (in chunk order) spends on each kind of compute over ``m``
    micro-batches (forward, backward, recompute, TP, CP, EP and FSDP comm: the compute streams'
    time split out by the chunks' shares), the sum of the first six, all its parameter all-gathers
    one after the other, and its gradient buckets' reduction times in chunk order."""
    forward = backward = recompute = tp = cp = ep = fsdp = 0.0
    for chunk in chunks:
        fb = chunk.backward_ns + chunk.recompute_ns
        keep = (1.0 - (chunk.tp_comm_backward_ns + chunk.cp_comm_backward_ns + chunk.ep_comm_backward_ns
                       + chunk.dp_comm_backward_ns) / fb if fb else 1.0)
        forward += m * (chunk.forward_ns - chunk.tp_comm_forward_ns - chunk.cp_comm_forward_ns
                        - chunk.ep_comm_forward_ns - chunk.dp_comm_forward_ns)
        backward += m * chunk.backward_ns * keep
        recompute += m * chunk.recompute_ns * keep
        tp += m * (chunk.tp_comm_forward_ns + chunk.tp_comm_backward_ns)
        cp += m * (chunk.cp_comm_forward_ns + chunk.cp_comm_backward_ns)
        ep += m * (chunk.ep_comm_forward_ns + chunk.ep_comm_backward_ns)
        fsdp += m * (chunk.dp_comm_forward_ns + chunk.dp_comm_backward_ns)
    computing = forward + backward + recompute + tp + cp + ep  # the first additions of the rank's busy time
    gathers = sum(g.comm_ns for chunk in chunks for g in chunk.param_gathers)
    buckets = tuple(b.comm_ns for chunk in chunks for b in chunk.dp_buckets)
    return forward, backward, recompute, tp, cp, ep, fsdp, computing, gathers, buckets


def _run_compute(work: PipelineWork, tasks: tuple[tuple[Task, ...], ...], intervals: list[list[Interval]] | None,
                 gates: list[float] | None = None) -> tuple[list[float], list[float], list[float], list[float]]:
    """Compute streams of all ranks: (end of each rank's last task, start of each virtual stage's
    last backward compute, each rank's time waiting on in-flight sends, each rank's time waiting on
    parameter all-gathers in its first forwards)."""
    pp, m = work.pipeline_parallel, work.num_microbatches
    chunks = work.chunks
    stages = len(chunks)
    last_stage = stages - 1
    fwd = [c.forward_ns for c in chunks]
    bwd = [c.backward_ns for c in chunks]
    rec = [c.recompute_ns for c in chunks]
    p2p_fwd = [c.p2p_forward_ns for c in chunks]
    p2p_bwd = [c.p2p_backward_ns for c in chunks]
    forward_end = [-1.0] * (stages * m)  # index: stage * m + micro-batch; -1 = not run yet
    backward_end = [-1.0] * (stages * m)
    last_backward_start = [0.0] * stages
    free = [0.0] * pp
    position = [0] * pp
    pp_wait = [0.0] * pp
    gate_wait = [0.0] * pp
    remaining = sum(len(t) for t in tasks)
    forward_kind = TaskKind.FORWARD
    while remaining:
        progressed = 0
        for r in range(pp):
            rank_tasks = tasks[r]
            i, t, n = position[r], free[r], len(rank_tasks)
            while i < n:
                task = rank_tasks[i]
                s = task.chunk * pp + r
                idx = s * m + task.microbatch
                is_forward = task.kind is forward_kind
                if is_forward and s:
                    dep = forward_end[idx - m]
                    if dep < 0.0:
                        break
                    send = p2p_fwd[s - 1]
                elif not is_forward and s < last_stage:
                    dep = backward_end[idx + m]
                    if dep < 0.0:
                        break
                    send = p2p_bwd[s + 1]
                else:  # first stage's forward, or last stage's backward after its own forward
                    dep = send = 0.0
                ready = dep + send
                if ready > t:
                    pp_wait[r] += min(ready - t, send)
                    t = ready
                start = t
                if is_forward:
                    t += fwd[s]
                    if gates is not None and task.microbatch == 0 and gates[s] > t:
                        gate_wait[r] += gates[s] - t
                        t = gates[s]
                    forward_end[idx] = t
                else:
                    last_backward_start[s] = start + rec[s]
                    t = start + rec[s] + bwd[s]
                    backward_end[idx] = t
                if intervals is not None:
                    if is_forward:
                        outgoing = p2p_fwd[s] if s < last_stage else 0.0
                    else:
                        outgoing = p2p_bwd[s] if s else 0.0
                    _record_task(intervals[r], task, start, t, rec[s], outgoing)
                i += 1
            if i != position[r]:
                progressed += i - position[r]
                position[r], free[r] = i, t
        if not progressed:
            raise RuntimeError(f"schedule {work.schedule.value} deadlocked with {remaining} tasks left")
        remaining -= progressed
    return free, last_backward_start, pp_wait, gate_wait


def _reduce_gradients(work: PipelineWork, r: int, compute_end: float, last_backward_start: list[float],
                      stream_free: float, intervals: list[list[Interval]] | None,
                      bucket_comms: tuple[float, ...]) -> float:
    """When rank ``r``'s gradients are reduced over the data-parallel group (its DP stream free
    from ``stream_free``, after the parameter all-gathers that open the iteration).
    ``bucket_comms``: its buckets' reduction times, in chunk order."""
    if not work.dp_overlap and intervals is None:  # one after another from the end of compute
        t = compute_end
        for comm in bucket_comms:
            t += comm
        return max(compute_end, t)
    pp = work.pipeline_parallel
    buckets = []
    for c in range(work.virtual_pipeline):
        s = c * pp + r
        chunk = work.chunks[s]
        for b in chunk.dp_buckets:
            ready = last_backward_start[s] + b.ready_fraction * chunk.backward_ns if work.dp_overlap else compute_end
            buckets.append((ready, b.comm_ns, c))
    if work.dp_overlap:
        buckets.sort(key=lambda bucket: bucket[0])
    t = compute_end if not work.dp_overlap else stream_free
    for k, (ready, comm, c) in enumerate(buckets):
        start = max(ready, t)
        t = start + comm
        if intervals is not None:
            intervals[r].append(Interval(stream=Stream.DP, kind=IntervalKind.DP_COMM,
                                         label=f"dp bucket {k} (chunk {c})", start_ns=start, end_ns=t, chunk=c))
    return max(compute_end, t)


def _record_task(out: list[Interval], task: Task, start: float, end: float, recompute: float,
                 send: float) -> None:
    mb, c = task.microbatch, task.chunk
    if task.kind is TaskKind.FORWARD:
        out.append(Interval(stream=Stream.COMPUTE, kind=IntervalKind.FORWARD, label=f"F{mb} c{c}",
                            start_ns=start, end_ns=end, chunk=c, microbatch=mb))
    else:
        if recompute:
            out.append(Interval(stream=Stream.COMPUTE, kind=IntervalKind.RECOMPUTE, label=f"R{mb} c{c}",
                                start_ns=start, end_ns=start + recompute, chunk=c, microbatch=mb))
        out.append(Interval(stream=Stream.COMPUTE, kind=IntervalKind.BACKWARD, label=f"B{mb} c{c}",
                            start_ns=start + recompute, end_ns=end, chunk=c, microbatch=mb))
    if send:
        direction = "activation" if task.kind is TaskKind.FORWARD else "gradient"
        out.append(Interval(stream=Stream.PP_SEND, kind=IntervalKind.PP_COMM, label=f"send {direction} {mb} c{c}",
                            start_ns=end, end_ns=end + send, chunk=c, microbatch=mb))
