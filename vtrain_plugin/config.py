"""Read a run description from disk: the project's plan file (YAML/JSON) or a vTrain config JSON.

A plan file has four sections, each the fields of one spec (see README, "Plan files"):
``model`` (:class:`ModelSpec`), ``parallel`` (:class:`ParallelPlan`), ``training``
(:class:`TrainingSpec`) and ``cluster`` (:class:`ClusterSpec`; ``preset`` names a base to override).
Every error is a :class:`ConfigError` naming the file, the field and the rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from vtrain_plugin import _validate as v
from vtrain_plugin.cluster import ClusterSpec, get_cluster_preset
from vtrain_plugin.errors import ConfigError
from vtrain_plugin.plan import ModelSpec, ParallelPlan
from vtrain_plugin.training import TrainingSpec

SECTIONS = ("model", "parallel", "training", "cluster")
_DEFAULT_PRESET_BY_GPU = {"a100-sxm4-80gb": "dgx-a100", "a100-sxm4-40gb": "dgx-a100",
                          "h100-sxm": "dgx-h100", "h200-sxm": "dgx-h200", "cpu": "local-cpu"}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Application (model), execution (parallel + training) and system (cluster), validated together."""

    model: ModelSpec
    parallel: ParallelPlan
    training: TrainingSpec
    cluster: ClusterSpec
    source: str = ""

    def __post_init__(self) -> None:
        self.parallel.check_fits(self.model)
        self.training.num_microbatches(self.parallel.data_parallel, self.parallel.micro_batch_size)

    @property
    def num_microbatches(self) -> int:
        return self.training.num_microbatches(self.parallel.data_parallel, self.parallel.micro_batch_size)


def load_run_config(path: str | Path) -> RunConfig:
    """Load and validate a plan file or vTrain config; errors are prefixed with the path."""
    path = Path(path)
    try:
        return run_config_from_dict(read_mapping(path), source=str(path))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def read_mapping(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML: {getattr(exc, 'problem', None) or exc}{where}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def run_config_from_dict(data: Mapping[str, Any], *, source: str = "") -> RunConfig:
    from megatron_adapters.config_map import from_vtrain_config, is_vtrain_config

    if is_vtrain_config(data):
        data = from_vtrain_config(data)
    v.no_unknown_keys("plan", data, SECTIONS)
    for section in ("model", "parallel", "training"):
        if section not in data:
            raise ConfigError(f"plan: missing section {section!r}")
    model = _build(ModelSpec, "model", data["model"])
    parallel = _build(ParallelPlan, "parallel", data["parallel"])
    training = _build(TrainingSpec, "training", data["training"])
    cluster = cluster_from_dict(data.get("cluster", {}))
    return RunConfig(model=model, parallel=parallel, training=training, cluster=cluster, source=source)


def cluster_from_dict(section: Mapping[str, Any]) -> ClusterSpec:
    """Resolve the GPU name (aliases like "A100"); fields not given come from a preset.

    The preset is ``preset`` if named, else the usual node of that GPU (DGX A100/H100/H200).
    """
    from profiler.devices import get_device

    section = dict(v.mapping("cluster", section))
    if "gpu" in section:
        section["gpu"] = get_device(section["gpu"]).name
    preset = section.pop("preset", None) or _DEFAULT_PRESET_BY_GPU.get(section.get("gpu", ""), "dgx-a100")
    base = get_cluster_preset(preset).to_dict()
    base.pop("name")
    return ClusterSpec.from_dict({**base, **section})


def _build(cls: type, section: str, values: Any) -> Any:
    values = v.mapping(section, values)
    v.no_unknown_keys(section, values, [f.name for f in fields(cls)])
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        missing = str(exc).split("'")[1] if "'" in str(exc) else str(exc)
        raise ConfigError(f"{section}: missing key {missing!r}") from None


def with_gpu(run: RunConfig, gpu: str) -> RunConfig:
    """The same run on another GPU: the cluster becomes that GPU's usual node (``--gpu``)."""
    from profiler.devices import get_device

    name = get_device(gpu).name
    if name == run.cluster.gpu:
        return run
    preset = get_cluster_preset(_DEFAULT_PRESET_BY_GPU.get(name, "dgx-a100")).to_dict()
    preset.pop("name")
    preset["gpu"] = name
    return replace(run, cluster=ClusterSpec.from_dict(preset))
