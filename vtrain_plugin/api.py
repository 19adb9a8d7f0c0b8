"""Run descriptions from files: a plan file (YAML/JSON) or a vTrain config JSON, resolved into a
:class:`RunConfig` against the hardware data (cluster presets, GPU aliases).

Every error is a :class:`ConfigError` naming the file, the field and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import cluster_for_gpu, resolve_cluster
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.plan_file import parse_plan, read_mapping
from vtrain_plugin.specs.run import RunConfig


def load_run_config(path: str | Path) -> RunConfig:
    """Load and validate a plan file or vTrain config; errors are prefixed with the path."""
    path = Path(path)
    try:
        return run_config_from_dict(read_mapping(path), source=str(path))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def run_config_from_dict(data: Mapping[str, Any], *, source: str = "") -> RunConfig:
    """The run of a plan-file (or vTrain config) mapping, its cluster resolved."""
    plan = parse_plan(data)
    return RunConfig(model=plan.model, parallel=plan.parallel, training=plan.training,
                     cluster=resolve_cluster(plan.cluster), source=source)


def with_gpu(run: RunConfig, gpu: str) -> RunConfig:
    """The same run on another GPU: the cluster becomes that GPU's usual node (``--gpu``)."""
    if get_device(gpu).name == run.cluster.gpu:
        return run
    return replace(run, cluster=cluster_for_gpu(gpu))
