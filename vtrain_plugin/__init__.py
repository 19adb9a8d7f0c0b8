"""vtrain: predict the iteration time and cost of Megatron-style LLM training before launch.

Typical use::

    import vtrain_plugin as vtrain
    graph = vtrain.trace(vtrain.ModelSpec(...), vtrain.ParallelPlan(tensor_parallel=8, ...))
    est = vtrain.estimate(graph, cluster=vtrain.get_cluster_preset("dgx-a100"), global_batch_size=1536)
    print(est.iteration_time_ms, est.breakdown_ms)
"""

from importlib import import_module
from typing import Any

# Public names and their modules, imported on first use (PEP 562): importing a submodule such as
# vtrain_plugin.graph from profiler must not pull in the estimator, which imports profiler back.
_EXPORTS = {
    "ClusterSpec": "cluster", "get_cluster_preset": "cluster",
    "RunConfig": "config", "load_run_config": "config",
    "ConfigError": "errors", "ProfileError": "errors", "TraceError": "errors", "VTrainError": "errors",
    "Estimate": "estimate", "estimate": "estimate",
    "OpGraph": "graph",
    "ModelSpec": "plan", "ParallelPlan": "plan",
    "trace": "tracer",
    "TrainingSpec": "training",
    "Comparison": "validate", "IterationRecorder": "validate", "ValidationResult": "validate",
    "compare": "validate", "single_device_run": "validate", "validation_table": "validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vtrain_plugin' has no attribute {name!r}")
    return getattr(import_module(f"vtrain_plugin.{module}"), name)
