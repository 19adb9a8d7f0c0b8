"""Parse a plan file (YAML or JSON) into specs: reading, parsing and validation, nothing resolved.

A plan file has four sections, each the fields of one spec (see README, "Plan files"): ``model``
(:class:`ModelSpec`), ``parallel`` (:class:`ParallelPlan`), ``training`` (:class:`TrainingSpec`) and
``cluster`` (the fields of :class:`ClusterSpec`, all optional, ``preset`` naming a base). The
cluster section is returned as given: named presets and GPU aliases are hardware data, resolved by
:func:`vtrain_plugin.hardware.clusters.resolve_cluster`. A vTrain config
(:mod:`vtrain_plugin.specs.vtrain_config`) is translated into these sections first.

YAML is read with YAML 1.2's float syntax (as JSON has it): ``270e9`` and ``2.7e11`` are numbers,
where PyYAML's YAML 1.1 rules would read them as strings (it wants a dot and a signed exponent).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec
from vtrain_plugin.specs.vtrain_config import from_vtrain_config, is_vtrain_config

SECTIONS = ("model", "parallel", "training", "cluster")


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load`` that also reads exponent forms without a dot or sign (``270e9``) as floats."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSections:
    model: ModelSpec
    parallel: ParallelPlan
    training: TrainingSpec
    cluster: Mapping[str, Any]  # unresolved cluster section


def read_mapping(path: Path) -> Mapping[str, Any]:
    """The top-level mapping of a JSON or YAML (``.yaml``/``.yml``) file; errors name the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_Loader)
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSections:
    """What a plan file says besides its parallel plan: the model, and defaults for a search."""

    model: ModelSpec
    training: TrainingSpec | None  # None when the file has no training section
    cluster: Mapping[str, Any]  # unresolved cluster section


def parse_plan(data: Mapping[str, Any]) -> PlanSections:
    """Build the specs of a plan-file mapping (or a vTrain config's)."""
    data = _sections(data)
    for section in ("model", "parallel", "training"):
        if section not in data:
            raise ConfigError(f"plan: missing section {section!r}")
    return PlanSections(model=build_spec(ModelSpec, "model", data["model"]),
                        parallel=build_spec(ParallelPlan, "parallel", data["parallel"]),
                        training=build_spec(TrainingSpec, "training", data["training"]),
                        cluster=v.mapping("cluster", data.get("cluster", {})))


def parse_model_sections(data: Mapping[str, Any]) -> ModelSections:
    """The model, training and cluster of a plan-file mapping (or a vTrain config's); only the
    model section is required, and the parallel section is not read."""
    data = _sections(data)
    if "model" not in data:
        raise ConfigError("plan: missing section 'model'")
    training = build_spec(TrainingSpec, "training", data["training"]) if "training" in data else None
    return ModelSections(model=build_spec(ModelSpec, "model", data["model"]), training=training,
                         cluster=v.mapping("cluster", data.get("cluster", {})))


def _sections(data: Mapping[str, Any]) -> Mapping[str, Any]:
    if is_vtrain_config(data):
        data = from_vtrain_config(data)
    v.no_unknown_keys("plan", data, SECTIONS)
    return data


def build_spec(cls: type, section: str, values: Any) -> Any:
    """``cls(**values)`` with unknown and missing keys reported by name."""
    values = v.mapping(section, values)
    v.no_unknown_keys(section, values, [f.name for f in fields(cls)])
    missing = [f.name for f in fields(cls)
               if f.default is MISSING and f.default_factory is MISSING and f.name not in values]
    if missing:
        raise ConfigError(f"{section}: missing key {missing[0]!r}")
    return cls(**values)
