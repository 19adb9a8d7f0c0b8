"""The discrete-event simulation of a shared cluster under one scheduling policy.

Jobs arrive at their submit time; a job whose curve has no point (no plan fits anywhere on the
cluster) is rejected on arrival with the curve's reason. Every arrival and finish triggers one
scheduling pass of the policy (:mod:`.policies.base`); the simulator checks its decision (allocation
units, counts with a plan, no overcommit: :class:`PolicyViolation` otherwise) and applies it. A job
progresses at its curve's speed on its current GPUs; every start and resize first costs
``restart_s`` seconds on the new GPUs without progress (checkpoint, relaunch, reload); a job set to
zero GPUs pauses. GPUs held, restarts included, are the busy GPU-hours the report charges.

With a :class:`~vtrain_plugin.planning.cluster.failures.FailureModel`, jobs also fail: a failure
loses the work since the job's last checkpoint and restarts it in place at the same restart cost
(see that module); the GPU-hours of lost work and of those restarts are the job's lost GPU-hours.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from vtrain_plugin.planning.progress import ProgressBar

from vtrain_plugin.core import checks as v
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.events import Arrival, Event, Failure, Finish, Schedule, run_events
from vtrain_plugin.planning.cluster.failures import Checkpointing, FailureModel
from vtrain_plugin.planning.cluster.jobs import Job
from vtrain_plugin.planning.cluster.policies import POLICIES, ClusterView, Decision, JobView, Policy

DEFAULT_RESTART_S = 120.0


class PolicyViolation(RuntimeError):
    """A policy broke a rule of the simulation (a bug in the policy, not in the user's input)."""


class Status(StrEnum):
    PENDING = "pending"  # not arrived
    ACTIVE = "active"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """``gpus`` GPUs held by ``job`` from ``start_s`` to ``end_s``."""

    job: str
    start_s: float
    end_s: float
    gpus: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOutcome:
    name: str
    submit_s: float
    deadline_s: float
    start_s: float | None
    finish_s: float | None
    rejected: str  # the reason; "" when not rejected
    gpu_seconds: float
    resizes: int  # allocation changes after the first start
    failures: int = 0
    lost_gpu_seconds: float = 0.0  # work lost to failures and the restarts they caused

    @property
    def met_deadline(self) -> bool:
        return self.finish_s is not None and self.finish_s <= self.deadline_s

    @property
    def jct_s(self) -> float:
        """Job completion time, submit to finish (NaN when it never finished)."""
        return math.nan if self.finish_s is None else self.finish_s - self.submit_s


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    policy: str
    cluster: ClusterConfig
    restart_s: float
    failures: FailureModel | None
    outcomes: tuple[JobOutcome, ...]
    segments: tuple[Segment, ...]
    events: int  # handled, stale finishes included
    passes: int  # scheduling passes: decisions of the policy


@dataclass(slots=True)
class _Run:
    """The mutable state of one job during one simulation."""

    job: Job
    curve: ThroughputCurve
    remaining: float  # iterations
    status: Status = Status.PENDING
    admitted: bool = False
    gpus: int = 0
    epoch: int = 0  # allocation changes so far: a Finish of an older epoch is stale
    clock_s: float = 0.0  # progress is accounted up to here
    productive_from_s: float = 0.0  # end of the current restart
    held_since_s: float = 0.0  # start of the current segment
    start_s: float | None = None
    finish_s: float | None = None
    rejected: str = ""
    gpu_seconds: float = 0.0
    resizes: int = 0
    checkpointing: Checkpointing | None = None  # of the current allocation, with failures on
    segment_remaining: float = 0.0  # iterations left when the current allocation started
    failure_restart: bool = False  # the current allocation's restart was caused by a failure
    failures: int = 0
    lost_gpu_seconds: float = 0.0

    def iteration_s(self, gpus: int) -> float:
        """Wall time per iteration on ``gpus``, checkpoint stalls included."""
        stretch = 1.0 if self.checkpointing is None else self.checkpointing.stretch
        return self.curve.iteration_s(gpus) * stretch


class Simulation:
    """One run of one policy over a job list (the target of the events, see :mod:`.events`)."""

    def __init__(self, jobs: Sequence[Job], curves: Mapping[str, ThroughputCurve], cluster: ClusterConfig,
                 policy: Policy, *, restart_s: float = DEFAULT_RESTART_S,
                 failures: FailureModel | None = None) -> None:
        self.cluster = cluster
        self.policy = policy
        self.restart_s = v.non_negative_number("restart_s", restart_s)
        self.runs = [_Run(job=job, curve=curves[job.name], remaining=float(job.iterations)) for job in jobs]
        self.segments: list[Segment] = []
        self._last_pass_s = -math.inf
        self.passes = 0
        self.failures = failures
        self._rng = None if failures is None else failures.generator()

    def arrive(self, job: int, time_s: float) -> list[Event]:
        run = self.runs[job]
        run.status = Status.ACTIVE
        if not run.curve.fits:
            run.status, run.rejected = Status.REJECTED, run.curve.reason
            return []
        return [Schedule(time_s)]

    def finish(self, job: int, epoch: int, time_s: float) -> list[Event]:
        run = self.runs[job]
        if run.status is not Status.ACTIVE or run.epoch != epoch:
            return []  # stale: the job was resized after this finish was predicted
        self._release(run, time_s)
        run.status, run.remaining, run.finish_s = Status.FINISHED, 0.0, time_s
        return [Schedule(time_s)]

    def fail(self, job: int, epoch: int, time_s: float) -> list[Event]:
        """A failure: back to the last checkpoint, and a restart in place (see the module doc)."""
        run = self.runs[job]
        if run.status is not Status.ACTIVE or run.epoch != epoch:
            return []
        productive = time_s - run.productive_from_s
        if productive > 0:
            cycle_s = run.checkpointing.interval_s + run.checkpointing.stall_s
            cycles = math.floor(productive / cycle_s)
            run.remaining = run.segment_remaining - cycles * run.checkpointing.interval_s / run.curve.iteration_s(run.gpus)
            lost_s = productive - cycles * cycle_s
        else:
            run.remaining = run.segment_remaining
            lost_s = -(run.productive_from_s - time_s) if run.failure_restart else 0.0  # its restart, cut short
        run.failures += 1
        run.lost_gpu_seconds += run.gpus * (lost_s + self.restart_s)
        gpus = run.gpus
        self._release(run, time_s)
        run.clock_s = time_s
        return self._allocate(job, run, gpus, time_s, after_failure=True)

    def schedule(self, time_s: float) -> list[Event]:
        if time_s == self._last_pass_s:
            return []  # one pass per instant, after every arrival and finish of that instant
        self._last_pass_s = time_s
        active = {i: run for i, run in enumerate(self.runs) if run.status is Status.ACTIVE}
        if not active:
            return []
        for run in active.values():
            self._advance(run, time_s)
        jobs = tuple(self._view(i, run, time_s) for i, run in active.items())
        view = ClusterView(now_s=time_s, total_gpus=self.cluster.total_gpus,
                           gpus_per_node=self.cluster.spec.gpus_per_node, unit_gpus=self.cluster.unit_gpus,
                           restart_s=self.restart_s, jobs=jobs)
        decision = self.policy.decide(view)
        self.passes += 1
        self._check(decision, active)
        for index, reason in decision.rejections.items():
            active[index].status, active[index].rejected = Status.REJECTED, reason
        events: list[Event] = []
        for index, run in active.items():
            if index in decision.rejections:
                continue
            run.admitted = True
            gpus = decision.allocations.get(index, 0)
            if gpus != run.gpus:
                events.extend(self._resize(index, run, gpus, time_s))
        return events

    def result(self, events: int) -> SimulationResult:
        left = [run for run in self.runs if run.status is not Status.FINISHED and run.status is not Status.REJECTED]
        if left:
            raise PolicyViolation(f"policy {self.policy.name} left {len(left)} job(s) unfinished with nothing "
                                  f"left to happen (first: {left[0].job.name}, {left[0].gpus} GPUs)")
        outcomes = tuple(JobOutcome(name=r.job.name, submit_s=r.job.submit_s, deadline_s=r.job.deadline_s,
                                    start_s=r.start_s, finish_s=r.finish_s, rejected=r.rejected,
                                    gpu_seconds=r.gpu_seconds, resizes=r.resizes, failures=r.failures,
                                    lost_gpu_seconds=r.lost_gpu_seconds) for r in self.runs)
        return SimulationResult(policy=self.policy.name, cluster=self.cluster, restart_s=self.restart_s,
                                failures=self.failures,
                                outcomes=outcomes, segments=tuple(self.segments), events=events,
                                passes=self.passes)

    def _view(self, index: int, run: _Run, now_s: float) -> JobView:
        return JobView(index=index, job=run.job, curve=run.curve, gpus=run.gpus, remaining_iterations=run.remaining,
                       admitted=run.admitted, started=run.start_s is not None,
                       restart_left_s=max(0.0, run.productive_from_s - now_s) if run.gpus else 0.0)

    def _check(self, decision: Decision, active: Mapping[int, _Run]) -> None:
        name = self.policy.name
        for index in decision.rejections:
            if index not in active or active[index].start_s is not None:
                raise PolicyViolation(f"policy {name} rejected job #{index}, which is not a waiting job")
        total = 0
        for index, gpus in decision.allocations.items():
            if index not in active or index in decision.rejections:
                raise PolicyViolation(f"policy {name} gave GPUs to job #{index}, which is not active")
            if gpus and (gpus % self.cluster.unit_gpus or gpus not in active[index].curve.counts):
                raise PolicyViolation(f"policy {name} gave {gpus} GPUs to {active[index].job.name}: not a multiple "
                                      f"of {self.cluster.unit_gpus} with a plan")
            if gpus < 0:
                raise PolicyViolation(f"policy {name} gave {gpus} GPUs to {active[index].job.name}")
            total += gpus
        if total > self.cluster.total_gpus:
            raise PolicyViolation(f"policy {name} allocated {total} GPUs of {self.cluster.total_gpus}")

    def _advance(self, run: _Run, now_s: float) -> None:
        if run.gpus:
            productive = max(0.0, now_s - max(run.clock_s, run.productive_from_s))
            run.remaining = max(0.0, run.remaining - productive / run.iteration_s(run.gpus))
        run.clock_s = now_s

    def _resize(self, index: int, run: _Run, gpus: int, now_s: float) -> list[Event]:
        if run.gpus:
            self._release(run, now_s)
        if run.start_s is not None:
            run.resizes += 1
        return self._allocate(index, run, gpus, now_s, after_failure=False)

    def _allocate(self, index: int, run: _Run, gpus: int, now_s: float, *, after_failure: bool) -> list[Event]:
        """Give ``run`` ``gpus`` GPUs from ``now_s``: a restart, then progress to its finish, and
        with failures on its next failure if that comes first."""
        run.epoch += 1
        run.gpus = gpus
        if not gpus:
            return []
        if run.start_s is None:
            run.start_s = now_s
        run.held_since_s = run.clock_s = now_s
        run.productive_from_s = now_s + self.restart_s
        run.segment_remaining, run.failure_restart = run.remaining, after_failure
        if self.failures is not None:
            run.checkpointing = self.failures.checkpointing(run.job.model, gpus=gpus, gpu=self.cluster.spec.gpu,
                                                            gpus_per_node=self.cluster.spec.gpus_per_node)
        end_s = run.productive_from_s + run.remaining * run.iteration_s(gpus)
        events: list[Event] = [Finish(end_s, index, run.epoch)]
        if self._rng is not None:
            failure_s = now_s + float(self._rng.exponential(run.checkpointing.mtbf_s))
            if failure_s < end_s:
                events.append(Failure(failure_s, index, run.epoch))
        return events

    def _release(self, run: _Run, now_s: float) -> None:
        if now_s > run.held_since_s:
            self.segments.append(Segment(job=run.job.name, start_s=run.held_since_s, end_s=now_s, gpus=run.gpus))
            run.gpu_seconds += run.gpus * (now_s - run.held_since_s)
        run.gpus = 0


def simulate(jobs: Sequence[Job], curves: Mapping[str, ThroughputCurve], cluster: ClusterConfig,
             policy: Policy | str, *, restart_s: float = DEFAULT_RESTART_S, progress: bool = False,
             failures: FailureModel | None = None) -> SimulationResult:
    """Run ``policy`` (an instance or a registered name) over ``jobs``; ``curves`` by job name;
    ``failures``: jobs fail and restart (None: they never fail)."""
    if isinstance(policy, str):
        policy = POLICIES.get(policy)()
    simulation = Simulation(jobs, curves, cluster, policy, restart_s=restart_s, failures=failures)
    arrivals = [Arrival(job.submit_s, i) for i, job in enumerate(jobs)]
    if not progress:
        return simulation.result(run_events(arrivals, simulation))
    with ProgressBar(total=len(jobs), desc=policy.name, unit="job", file=sys.stderr) as bar:
        def on_event(event: Event) -> None:
            done = sum(r.status in (Status.FINISHED, Status.REJECTED) for r in simulation.runs)
            if done != bar.n:
                bar.update(done - bar.n)
        return simulation.result(run_events(arrivals, simulation, on_event))
