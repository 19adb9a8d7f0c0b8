"""``edf-linear``: the same deadline-aware elastic scheduler, believing that throughput grows
linearly with GPUs from the job's speed on one node: "twice the GPUs, half the time".

The reference is the job's fastest plan on one node (the largest count up to a node's GPUs with a
plan), or on its smallest count when it needs more than a node. The jobs then run at their real
speed (vtrain's curve), so this belief admits jobs it cannot finish, gives too few GPUs to meet a
deadline, and hands out GPUs that buy little: the heuristic the vTrain paper argues against.
"""

from __future__ import annotations

import numpy as np

from vtrain_plugin.planning.cluster.policies.base import POLICIES, ClusterView, JobView
from vtrain_plugin.planning.cluster.policies.elastic_edf import ElasticEdf


@POLICIES.register("edf-linear")
class EdfLinear(ElasticEdf):
    name = "edf-linear"
    summary = "earliest deadline first, elastic, with admission control, assuming speed linear in GPUs"

    def believed_iteration_s(self, job: JobView, view: ClusterView) -> np.ndarray:
        counts = np.array(job.curve.counts)
        within_node = counts[counts <= view.gpus_per_node]
        reference = int(within_node[-1]) if len(within_node) else int(counts[0])
        return job.curve.iteration_s(reference) * reference / counts
