"""``edf-vtrain``: deadline-aware elastic scheduling that believes vtrain's throughput curves.

The minimum share that meets a deadline, admission control and the marginal gain of more GPUs are
all read from each job's curve (the fastest plan vtrain finds at each count), so a job is never
given GPUs that do not make it faster, and a deadline it admits is one it can meet.
"""

from __future__ import annotations

import numpy as np

from vtrain_plugin.planning.cluster.policies.base import POLICIES, ClusterView, JobView
from vtrain_plugin.planning.cluster.policies.elastic_edf import ElasticEdf


@POLICIES.register("edf-vtrain")
class EdfVtrain(ElasticEdf):
    name = "edf-vtrain"
    summary = "earliest deadline first, elastic, with admission control, on vtrain's speed at every GPU count"

    def believed_iteration_s(self, job: JobView, view: ClusterView) -> np.ndarray:
        return np.array([job.curve.iteration_s(n) for n in job.curve.counts])
