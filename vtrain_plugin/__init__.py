"""vtrain: predict the iteration time and cost of Megatron-style LLM training before launch.

Typical use::

    import vtrain_plugin as vtrain
    graph = vtrain.trace(vtrain.ModelSpec(...), vtrain.ParallelPlan(tensor_parallel=8, ...))
    est = vtrain.estimate(graph, cluster=vtrain.get_cluster_preset("dgx-a100"), global_batch_size=1536)
    print(est.iteration_time_ms, est.breakdown_ms)
"""

from vtrain_plugin.cluster import ClusterSpec, get_cluster_preset
from vtrain_plugin.config import RunConfig, load_run_config
from vtrain_plugin.errors import ConfigError, ProfileError, TraceError, VTrainError
from vtrain_plugin.estimate import Estimate, estimate
from vtrain_plugin.graph import OpGraph
from vtrain_plugin.plan import ModelSpec, ParallelPlan
from vtrain_plugin.tracer import trace
from vtrain_plugin.training import TrainingSpec

__all__ = [
    "ClusterSpec", "ConfigError", "Estimate", "ModelSpec", "OpGraph", "ParallelPlan", "ProfileError",
    "RunConfig", "TraceError", "TrainingSpec", "VTrainError", "estimate", "get_cluster_preset",
    "load_run_config", "trace",
]
