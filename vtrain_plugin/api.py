"""Run descriptions from files: a plan file (YAML/JSON) or a vTrain config JSON, resolved into a
:class:`RunConfig` against the hardware data (cluster presets, GPU aliases).

Every error is a :class:`ConfigError` naming the file, the field and the rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import cluster_for_gpu, resolve_cluster
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.plan_file import parse_model_sections, parse_plan
from vtrain_plugin.specs.reading import read_mapping
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import TrainingSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFile:
    """The model of a plan file or vTrain config, with its training and cluster (``vtrain search``
    takes them as defaults); the file's parallel plan is not read."""

    model: ModelSpec
    training: TrainingSpec | None  # None when the file has no training section
    cluster: ClusterSpec
    source: str


def load_run_config(path: str | Path) -> RunConfig:
    """Load and validate a plan file or vTrain config; errors are prefixed with the path."""
    path = Path(path)
    with _errors_name(path):
        return run_config_from_dict(read_mapping(path), source=str(path))


def load_model_file(path: str | Path) -> ModelFile:
    """The model part of a plan file or vTrain config (see :class:`ModelFile`); errors are
    prefixed with the path."""
    path = Path(path)
    with _errors_name(path):
        sections = parse_model_sections(read_mapping(path))
        return ModelFile(model=sections.model, training=sections.training,
                         cluster=resolve_cluster(sections.cluster), source=str(path))


@contextmanager
def _errors_name(path: Path) -> Iterator[None]:
    try:
        yield
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
