"""Named clusters as data files, and the resolution of a plan's cluster section against them.

Each preset is ``data/clusters/<name>.json``: the fields of :class:`ClusterSpec` plus
``description`` and ``reference`` (where the numbers come from). A plan's cluster section names a
``preset`` to start from, or a ``gpu`` whose usual node (the device's ``default_cluster``) is the
base; the keys it gives override the base's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.hardware.nccl import available_table_sets
from vtrain_plugin.specs.cluster import ClusterSpec

_DOCUMENTATION_KEYS = ("description", "reference")
DEFAULT_GPU = "a100-sxm4-80gb"  # a cluster section that names neither preset nor GPU


def _preset_dir() -> Path:
    return Path(__file__).with_name("data") / "clusters"


def cluster_preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _preset_dir().glob("*.json")))


@lru_cache(maxsize=None)
def get_cluster_preset(name: str) -> ClusterSpec:
    """The preset called ``name`` (``dgx-a100``, ``dgx-h100``, ``dgx-h200``, ``dgx-b200``, ``local-cpu``)."""
    names = cluster_preset_names()
    if name not in names:
        raise ConfigError(f"unknown cluster preset {v.show(name)}; valid presets are {', '.join(names)}")
    path = _preset_dir() / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cluster preset {path}: {exc}") from None
    data = dict(v.mapping(f"cluster preset {path.name}", data))
    for key in _DOCUMENTATION_KEYS:
        data.pop(key, None)
    if data.get("name") != name:
        raise ConfigError(f"cluster preset {path.name}: name {data.get('name')!r} must equal the file name {name!r}")
    return _checked(data, where=f"cluster preset {path.name}")


def resolve_cluster(section: Mapping[str, Any]) -> ClusterSpec:
    """The cluster of a plan's ``cluster`` section (see the module doc); GPU aliases are resolved."""
    section = dict(v.mapping("cluster", section))
    v.no_unknown_keys("cluster", section, [*(f.name for f in fields(ClusterSpec)), "preset"])
    if "gpu" in section:
        section["gpu"] = get_device(v.string("cluster.gpu", section["gpu"])).name
    preset = section.pop("preset", None)
    if preset is not None:
        v.string("cluster.preset", preset)
    else:
        preset = get_device(section.get("gpu", DEFAULT_GPU)).default_cluster
    base = get_cluster_preset(preset).to_dict()
    base.pop("name")
    return _checked({**base, **section}, where="cluster")


def cluster_for_gpu(gpu: str) -> ClusterSpec:
    """The usual node of ``gpu`` (a preset name or alias), with that GPU (``vtrain estimate --gpu``)."""
    return resolve_cluster({"gpu": gpu})


def _checked(data: dict[str, Any], *, where: str) -> ClusterSpec:
    v.no_unknown_keys(where, data, [f.name for f in fields(ClusterSpec)])
    tables = data.get("nccl_tables")
    if tables is not None:
        v.one_of(f"{where}.nccl_tables", tables, available_table_sets())
    try:
        return ClusterSpec(**data)
    except TypeError:  # a required field is missing
        missing = sorted({f.name for f in fields(ClusterSpec)} - set(data))
        raise ConfigError(f"{where}: missing key {missing[0]!r}") from None
