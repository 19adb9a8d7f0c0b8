"""``fifo-static``: every job gets the GPU count it asked for, in arrival order, and keeps it.

The baseline of a cluster without vtrain: no resizing and no admission control (deadlines are not
looked at). Jobs start in order of priority and arrival; when the first waiting job does not fit in
the free GPUs, the jobs behind it wait too (strict FIFO, no backfilling). A job that asks for no
count gets the smallest with a plan that fits; one that asks for more than the cluster, or for a
count without such a plan, is rejected with the counts it could have had.
"""

from __future__ import annotations

from vtrain_plugin.planning.cluster.policies.base import (POLICIES, ClusterView, Decision, JobView, Policy,
                                                          arrival_order)


@POLICIES.register("fifo-static")
class FifoStatic(Policy):
    name = "fifo-static"
    summary = "each job gets the GPUs it asked for, first come first served, never resized"

    def decide(self, view: ClusterView) -> Decision:
        allocations = {j.index: j.gpus for j in view.jobs if j.gpus}
        free = view.total_gpus - sum(allocations.values())
        rejections = {j.index: reason for j in view.jobs if not j.admitted
                      for reason in [self.refusal(j, self.asked(j), view.total_gpus)] if reason}
        for job in sorted((j for j in view.jobs if not j.gpus and j.index not in rejections), key=arrival_order):
            asked = self.asked(job)
            if asked > free:
                break
            allocations[job.index] = asked
            free -= asked
        return Decision(allocations=allocations, rejections=rejections)

    @staticmethod
    def asked(job: JobView) -> int:
        return job.job.requested_gpus if job.job.requested_gpus is not None else job.curve.min_gpus

    @staticmethod
    def refusal(job: JobView, asked: int, total_gpus: int) -> str:
        if asked > total_gpus:
            return f"asks for {asked} GPUs, the cluster has {total_gpus}"
        if asked not in job.curve.counts:
            counts = ", ".join(map(str, job.curve.counts[:8])) + (", ..." if len(job.curve.counts) > 8 else "")
            return f"no plan fits on the {asked} GPUs it asks for (counts with one: {counts})"
        return ""
