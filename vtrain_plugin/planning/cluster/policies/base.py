"""What a scheduling policy sees and decides, and the registry of policies by name.

At every scheduling pass (a job arrived or finished) the simulator shows the policy a
:class:`ClusterView` of the active jobs (arrived, neither finished nor rejected) and the policy
returns a :class:`Decision`: the GPUs of every job from now on (absent: none, the job waits) and the
jobs it rejects. Jobs shown for the first time are not yet ``admitted``: the policy admits them by
not rejecting them; a job that has run cannot be rejected. The simulator enforces the rules (whole
allocation units, counts the job has a plan for, no overcommit) and charges the restart cost of
every start and resize, so a policy is only its decision.

A policy is a class with a ``name``, registered with ``@POLICIES.register(name)`` in a module of
this package (every module of the package is imported, so adding a policy is adding a file).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from vtrain_plugin.core.registry import Registry
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.jobs import Job


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    index: int  # the job's position in the job list: the key of a decision
    job: Job
    curve: ThroughputCurve  # vtrain's curve: counts with a plan, and their iteration times
    gpus: int  # GPUs now (0: waiting)
    remaining_iterations: float
    admitted: bool  # admitted at an earlier pass
    started: bool  # has had GPUs
    restart_left_s: float  # until the job trains again on its current GPUs (0 when it trains)

    def finish_s(self, now_s: float, restart_s: float, gpus: int, iteration_s: float) -> float:
        """When the job would finish on ``gpus`` GPUs at ``iteration_s`` seconds per iteration:
        a change of allocation pays the restart cost, keeping the current one does not."""
        restart = self.restart_left_s if gpus == self.gpus else restart_s
        return now_s + restart + self.remaining_iterations * iteration_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterView:
    now_s: float
    total_gpus: int
    gpus_per_node: int
    unit_gpus: int  # allocations are multiples of this
    restart_s: float  # cost of a start or resize
    jobs: tuple[JobView, ...]  # active jobs, in job-list order


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    allocations: Mapping[int, int] = field(default_factory=dict)  # job index -> GPUs (absent: 0)
    rejections: Mapping[int, str] = field(default_factory=dict)  # job index -> reason


class Policy(ABC):
    """A scheduling policy; one instance serves one simulation (it may keep state between passes)."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for --help and reports

    @abstractmethod
    def decide(self, view: ClusterView) -> Decision:
        """The allocation from ``view.now_s`` on, and the jobs rejected."""


POLICIES: Registry[type[Policy]] = Registry("policy", plural="policies")


def deadline_order(job: JobView) -> tuple:
    """Earliest deadline first; then higher priority, earlier submission, job-list order."""
    return job.job.deadline_s, -job.job.priority, job.job.submit_s, job.index


def arrival_order(job: JobView) -> tuple:
    """Higher priority first; then earlier submission, job-list order."""
    return -job.job.priority, job.job.submit_s, job.index
