"""Parse a plan file (YAML or JSON) into specs: parsing and validation, nothing resolved.

A plan file has four sections, each the fields of one spec (see README, "Plan files"): ``model``
(:class:`ModelSpec`), ``parallel`` (:class:`ParallelPlan`), ``training`` (:class:`TrainingSpec`) and
``cluster`` (the fields of :class:`ClusterSpec`, all optional, ``preset`` naming a base), and an
optional fifth, ``reliability`` (:class:`ReliabilitySpec`, ``TrainingSpec.reliability``; ``off`` or
null turns failures off). The
cluster section is returned as given: named presets and GPU aliases are hardware data, resolved by
:func:`vtrain_plugin.hardware.clusters.resolve_cluster`. A vTrain config
(:mod:`vtrain_plugin.specs.vtrain_config`) is translated into these sections first.

Files are read into mappings by :mod:`vtrain_plugin.specs.reading`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.model_features import REFUSED, not_modelled
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.training import TrainingSpec
from vtrain_plugin.specs.vtrain_config import from_vtrain_config, is_vtrain_config

SECTIONS = ("model", "parallel", "training", "cluster", "reliability")
FAILURES_OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSections:
    model: ModelSpec
    parallel: ParallelPlan
    training: TrainingSpec
    cluster: Mapping[str, Any]  # unresolved cluster section


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
    return PlanSections(model=_model(data["model"]),
                        parallel=build_spec(ParallelPlan, "parallel", data["parallel"]),
                        training=_training(data, data["training"]),
                        cluster=v.mapping("cluster", data.get("cluster", {})))


def parse_model_sections(data: Mapping[str, Any]) -> ModelSections:
    """The model, training and cluster of a plan-file mapping (or a vTrain config's); only the
    model section is required, and the parallel section is not read."""
    data = _sections(data)
    if "model" not in data:
        raise ConfigError("plan: missing section 'model'")
    training = _training(data, data["training"]) if "training" in data else None
    return ModelSections(model=_model(data["model"]), training=training,
                         cluster=v.mapping("cluster", data.get("cluster", {})))


def plan_document(model: ModelSpec, parallel: ParallelPlan, training: TrainingSpec,
                  cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The plan file of these specs, which :func:`parse_plan` reads back to equal specs: every field
    of each, the training's reliability as the top-level ``reliability`` section (``off`` for None),
    and ``cluster`` as given (the fields of a resolved :class:`ClusterSpec`)."""
    training_section = training.to_dict()
    reliability = training_section.pop("reliability")
    return {"model": model.to_dict(), "parallel": parallel.to_dict(), "training": training_section,
            "cluster": dict(cluster), "reliability": FAILURES_OFF if reliability is None else reliability}


def _model(section: Any) -> ModelSpec:
    """The model section; a key naming a layer feature vtrain refuses on every input path
    (:data:`vtrain_plugin.specs.model_features.REFUSED`) is refused as on the others when it turns
    the feature on, and changes nothing when it leaves it off."""
    values = dict(v.mapping("model", section))
    for feature in REFUSED:
        if values.pop(feature.plan_key, None):
            raise not_modelled(f"model.{feature.plan_key}", feature.what)
    return build_spec(ModelSpec, "model", values)


def _training(data: Mapping[str, Any], section: Any) -> TrainingSpec:
    """The training section, with the file's reliability section (default: failures on, the
    defaults of :class:`ReliabilitySpec`)."""
    if "reliability" in v.mapping("training", section):
        raise ConfigError("training: unknown key 'reliability'; failures, restarts and checkpoints are the plan "
                          "file's top-level reliability section")
    training = build_spec(TrainingSpec, "training", section)
    if "reliability" not in data:
        return training
    given = data["reliability"]
    if given is None or given == FAILURES_OFF:
        return replace(training, reliability=None)
    return replace(training, reliability=build_spec(ReliabilitySpec, "reliability", given))


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
