"""Traced graphs as JSON files: the versioned, portable form of an :class:`OpGraph`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.core.graph import SCHEMA_VERSION, OpGraph, StageGraph
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan


def graph_from_dict(d: dict[str, Any]) -> OpGraph:
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ConfigError(f"graph schema_version {version!r} is not supported (this vtrain reads {SCHEMA_VERSION})")
    model = d["model"]
    return OpGraph(model=None if model is None else ModelSpec(**model), module_name=d["module_name"],
                   parallel=ParallelPlan(**d["parallel"]), micro_batch_size=d["micro_batch_size"],
                   seq_length=d["seq_length"], stages=tuple(StageGraph.from_dict(s) for s in d["stages"]))


def save_graph(graph: OpGraph, path: str | os.PathLike) -> None:
    atomic_write_text(Path(path), json.dumps(graph.to_dict(), separators=(",", ":")))


def load_graph(path: str | os.PathLike) -> OpGraph:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"graph file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"graph file {path}: the top level must be a mapping")
    return graph_from_dict(data)
