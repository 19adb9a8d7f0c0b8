"""vtrain: predict the iteration time, memory and cost of Megatron-style LLM training before launch.

Typical use::

    import vtrain_plugin as vtrain
    graph = vtrain.trace(vtrain.ModelSpec(...), vtrain.ParallelPlan(tensor_parallel=8, ...))
    est = vtrain.estimate(graph, cluster=vtrain.get_cluster_preset("dgx-a100"), global_batch_size=1536)
    print(est.iteration_time_ms, est.breakdown_ms)

The public names load on first use (PEP 562): ``import vtrain_plugin`` and every ``vtrain`` command
pay only for the modules they touch, so a warm ``vtrain estimate`` never loads the tracer (torch,
megatron-core) nor the measured-run readers.

The layers of the package, lowest first (each imports only the ones before it): ``core``, ``specs``,
``hardware``, ``capture``, ``cost``, ``sim``, ``runs`` (run descriptions from files), ``estimate``,
``measured`` (predicted against measured: logs, timed iterations, one-device runs, calibration),
``planning`` and ``cli``; see ``../shared/DESIGN.md`` ("Layout") and setup.cfg's import contract.
"""

import importlib as _importlib
import sys as _sys
import types as _types
import warnings as _warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as type checkers and IDEs see them; at run time __getattr__ loads them
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.core.errors import ConfigError, ProfileError, TraceError, VTrainError
    from vtrain_plugin.core.graph import OpGraph
    from vtrain_plugin.estimate import Estimate, estimate, estimates_frame
    from vtrain_plugin.hardware.clusters import get_cluster_preset
    from vtrain_plugin.measured.compare_run import RunComparison, compare_run
    from vtrain_plugin.measured.iterations import IterationComparison, IterationRecorder, compare_iterations
    from vtrain_plugin.measured.one_device import ValidationResult, single_device_run, validate
    from vtrain_plugin.runs import (Hardware, load_bridge_config, load_megatron_script, load_run, load_run_config,
                                    run_config_from_dict, run_config_from_megatron_args, with_gpu)
    from vtrain_plugin.specs.cluster import ClusterSpec
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan
    from vtrain_plugin.specs.reliability import ReliabilitySpec
    from vtrain_plugin.specs.run import RunConfig
    from vtrain_plugin.specs.training import TrainingSpec

# public name -> the module that defines it (tests/unit/test_package_names.py checks it against __all__)
_HOMES = {
    "trace": "capture.tracer",
    **dict.fromkeys(("ConfigError", "ProfileError", "TraceError", "VTrainError"), "core.errors"),
    "OpGraph": "core.graph",
    **dict.fromkeys(("Estimate", "estimate", "estimates_frame"), "estimate"),
    "get_cluster_preset": "hardware.clusters",
    **dict.fromkeys(("RunComparison", "compare_run"), "measured.compare_run"),
    **dict.fromkeys(("IterationComparison", "IterationRecorder", "compare_iterations"), "measured.iterations"),
    **dict.fromkeys(("ValidationResult", "single_device_run", "validate"), "measured.one_device"),
    **dict.fromkeys(("Hardware", "load_bridge_config", "load_megatron_script", "load_run", "load_run_config",
                     "run_config_from_dict", "run_config_from_megatron_args", "with_gpu"), "runs"),
    "ClusterSpec": "specs.cluster",
    "ModelSpec": "specs.model",
    "ParallelPlan": "specs.parallel",
    "ReliabilitySpec": "specs.reliability",
    "RunConfig": "specs.run",
    "TrainingSpec": "specs.training",
}

# a literal list, so that linters see the names imported for type checkers above as used
__all__ = ["ClusterSpec", "ConfigError", "Estimate", "Hardware", "IterationComparison", "IterationRecorder",
           "ModelSpec", "OpGraph", "ParallelPlan", "ProfileError", "ReliabilitySpec", "RunComparison", "RunConfig",
           "TraceError", "TrainingSpec", "VTrainError", "ValidationResult", "compare_iterations", "compare_run",
           "estimate", "estimates_frame", "get_cluster_preset", "load_bridge_config", "load_megatron_script",
           "load_run", "load_run_config", "run_config_from_dict", "run_config_from_megatron_args",
           "single_device_run", "trace", "validate", "with_gpu"]

# Names that said less than they meant ("compare" beside "compare_run"): importable still, with a warning.
_DEPRECATED = {"compare": "compare_iterations", "Comparison": "IterationComparison"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(_importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value  # later look-ups are plain attribute reads
        return value
    if name in _DEPRECATED:
        new_name = _DEPRECATED[name]
        _warnings.warn(f"vtrain_plugin.{name} is deprecated; use vtrain_plugin.{new_name} (timed iterations; "
                       f"compare_run compares the logs of a run)", DeprecationWarning, stacklevel=2)
        return __getattr__(new_name)
    raise AttributeError(f"module 'vtrain_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# Public names that are also the names of their modules: importing the module vtrain_plugin.estimate
# binds it on the package, over the function vtrain_plugin.estimate; the package keeps the function.
_SHADOWED = frozenset(name for name, home in _HOMES.items() if home == name)


class _Package(_types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
