"""Deadline-aware elastic scheduling in the style of ElasticFlow (Gu et al., NSDI'23), over a
belief about each job's speed at each GPU count; its subclasses differ only in that belief.

At every pass the policy plans the future on a :class:`CapacityProfile` of free GPUs:

1. jobs admitted earlier, earliest deadline first, reserve their *minimum satisfactory share*: the
   fewest GPUs that, kept from the earliest start the free GPUs allow, finish the job by its
   deadline (a change of allocation pays the restart cost). A job that can no longer make its
   deadline reserves its current GPUs (or its smallest count) from the earliest start;
2. new jobs, earliest deadline first, are admitted when they can reserve such a share in what is
   left, and rejected otherwise (admission control: nothing admitted later can take the GPUs an
   admitted job was planned with);
3. jobs whose reservation starts now get it now; the GPUs still free now go, a step at a time, to
   the job whose finish time drops the most per extra GPU when it moves to its next faster count
   (the largest marginal gain; a waiting job gains most). The next pass plans again.
"""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod

import numpy as np

from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.planning.cluster.policies.base import ClusterView, Decision, JobView, Policy, deadline_order
from vtrain_plugin.planning.cluster.policies.capacity import CapacityProfile, Reservation


class ElasticEdf(Policy):
    def __init__(self) -> None:
        self._beliefs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @abstractmethod
    def believed_iteration_s(self, job: JobView, view: ClusterView) -> np.ndarray:
        """Seconds per iteration the policy expects at each of ``job.curve.counts``."""

    def decide(self, view: ClusterView) -> Decision:
        ordered = sorted(view.jobs, key=deadline_order)
        profile = CapacityProfile(view.now_s, view.total_gpus)
        plans: dict[int, Reservation] = {}
        for job in (j for j in ordered if j.admitted):
            plan = self._reservation(job, view, profile)
            if plan is None:  # late: keep going on its GPUs, or on its smallest count
                counts, _ = self._belief(job, view)
                keep = np.flatnonzero(counts == (job.gpus or counts[0]))
                plan = self._reservation(job, view, profile, only=keep, deadline_s=math.inf)
            profile.reserve(plan)
            plans[job.index] = plan
        rejections = {}
        for job in (j for j in ordered if not j.admitted):
            plan = self._reservation(job, view, profile)
            if plan is None:
                rejections[job.index] = self._refusal(job, view)
            else:
                profile.reserve(plan)
                plans[job.index] = plan
        shares = {i: plan.gpus if plan.start_s == view.now_s else 0 for i, plan in plans.items()}
        jobs = {j.index: j for j in ordered if j.index in shares}
        self._hand_out(profile.free_now, shares, jobs, {i: self._finish_s(j, view) for i, j in jobs.items()}, view)
        return Decision(allocations={i: n for i, n in shares.items() if n}, rejections=rejections)

    def _belief(self, job: JobView, view: ClusterView) -> tuple[np.ndarray, np.ndarray]:
        """(counts up to the cluster's GPUs, believed seconds per iteration), computed once per job."""
        if job.index not in self._beliefs:
            counts = np.array(job.curve.counts)
            within = counts <= view.total_gpus
            self._beliefs[job.index] = counts[within], self.believed_iteration_s(job, view)[within]
        return self._beliefs[job.index]

    def _run_s(self, job: JobView, view: ClusterView) -> tuple[np.ndarray, np.ndarray]:
        """Believed run time at each count, started now and started later (restart always paid)."""
        counts, seconds = self._belief(job, view)
        work = job.remaining_iterations * seconds
        return np.where(counts == job.gpus, job.restart_left_s, view.restart_s) + work, view.restart_s + work

    def _finish_s(self, job: JobView, view: ClusterView) -> np.ndarray:
        return view.now_s + self._run_s(job, view)[0]

    def _reservation(self, job: JobView, view: ClusterView, profile: CapacityProfile, *,
                     only: np.ndarray | None = None, deadline_s: float | None = None) -> Reservation | None:
        counts, _ = self._belief(job, view)
        now, later = self._run_s(job, view)
        if only is not None:
            counts, now, later = counts[only], now[only], later[only]
        return profile.earliest(counts, now, later, job.job.deadline_s if deadline_s is None else deadline_s)

    def _refusal(self, job: JobView, view: ClusterView) -> str:
        deadline = _hours(job.job.deadline_s)
        counts, _ = self._belief(job, view)
        if not len(counts):
            return f"needs at least {job.curve.min_gpus} GPUs, the cluster has {view.total_gpus}"
        alone = self._reservation(job, view, CapacityProfile(view.now_s, view.total_gpus))
        if alone is None:
            finish = self._finish_s(job, view)
            fastest = int(np.argmin(finish))
            return (f"cannot finish by its deadline ({deadline}): on {counts[fastest]} GPUs, the fastest it "
                    f"expects, it would finish at {_hours(finish[fastest])}")
        return (f"cannot finish by its deadline ({deadline}) in the GPUs the jobs admitted before leave; "
                f"alone it would need {alone.gpus} GPUs from now")

    def _hand_out(self, free: int, shares: dict[int, int], jobs: dict[int, JobView],
                  finish: dict[int, np.ndarray], view: ClusterView) -> None:
        """Give ``free`` GPUs away by largest marginal gain (step 3 of the module doc), in place."""
        rank = {index: position for position, index in enumerate(jobs)}

        def next_step(index: int) -> tuple[float, int] | None:
            """(seconds saved per extra GPU, count) of the better of two moves that fit in ``free``:
            to the smallest faster count, or back to the job's current GPUs (no restart)."""
            counts = self._belief(jobs[index], view)[0]
            base = shares[index]
            now = math.inf if base == 0 else finish[index][np.searchsorted(counts, base)]
            steps = []
            for position in np.flatnonzero((counts > base) & (counts - base <= free)):
                if finish[index][position] < now:
                    steps.append(position)
                    break
            if jobs[index].gpus > base and jobs[index].gpus - base <= free:
                steps.append(np.searchsorted(counts, jobs[index].gpus))
            gains = [((now - finish[index][p]) / (counts[p] - base), int(counts[p])) for p in steps
                     if finish[index][p] < now]
            return max(gains, default=None)

        heap = []
        for index in shares:
            step = next_step(index)
            if step is not None:
                heapq.heappush(heap, (-step[0], rank[index], index, shares[index], step[1]))
        while heap and free > 0:
            _, position, index, base, count = heapq.heappop(heap)
            if base != shares[index]:
                continue  # stale: the job moved since
            if count - base <= free:
                shares[index] = count
                free -= count - base
            step = next_step(index)  # the next step from the new share, or within what is left
            if step is not None:
                heapq.heappush(heap, (-step[0], position, index, shares[index], step[1]))


def _hours(seconds: float) -> str:
    return f"{seconds / SECONDS_PER_HOUR:.2f} h"
