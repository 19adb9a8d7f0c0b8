"""vtrain: predict the iteration time, memory and cost of Megatron-style LLM training before launch.

Typical use::

    import vtrain_plugin as vtrain
    graph = vtrain.trace(vtrain.ModelSpec(...), vtrain.ParallelPlan(tensor_parallel=8, ...))
    est = vtrain.estimate(graph, cluster=vtrain.get_cluster_preset("dgx-a100"), global_batch_size=1536)
    print(est.iteration_time_ms, est.breakdown_ms)

The layers of the package, lowest first (each imports only the ones before it): ``core``, ``specs``,
``runlogs`` (training logs of measured runs), ``hardware``, ``capture``, ``cost``, ``sim``, then the
public API (``api``, ``estimate``, ``validation`` and ``measure`` (``validate(run)``: train one
device for real and compare), and ``fitting``: predicted against measured runs),
``planning`` (``vtrain_plugin.planning.search``) and ``cli``; see README, "How the code is laid out".
"""

from vtrain_plugin.api import (load_megatron_script, load_run_config, run_config_from_dict,
                               run_config_from_megatron_args, with_gpu)
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.errors import ConfigError, ProfileError, TraceError, VTrainError
from vtrain_plugin.core.graph import OpGraph
from vtrain_plugin.estimate import Estimate, estimate, estimates_frame
from vtrain_plugin.fitting.compare import RunComparison, compare_run
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import TrainingSpec
from vtrain_plugin.measure import validate
from vtrain_plugin.validation import Comparison, IterationRecorder, ValidationResult, compare, single_device_run

__all__ = ["ClusterSpec", "Comparison", "ConfigError", "Estimate", "IterationRecorder", "ModelSpec", "OpGraph",
           "ParallelPlan", "ProfileError", "ReliabilitySpec", "RunComparison", "RunConfig", "TraceError",
           "TrainingSpec", "VTrainError", "ValidationResult", "compare", "compare_run", "estimate",
           "estimates_frame", "get_cluster_preset", "load_megatron_script", "load_run_config",
           "run_config_from_dict", "run_config_from_megatron_args", "single_device_run", "trace", "validate",
           "with_gpu"]
