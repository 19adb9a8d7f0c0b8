"""Curves computed once: in this process, and on disk in the folder of the trace cache.

An entry is one JSON file, ``<cache>/curves/<key>.json``, written atomically; the key is the SHA-256
of everything the curve depends on: the model's dimensions, the global batch, the node (GPU, links),
the allocatable counts, the curve space, the calibration constants of the GPU and software stack,
the profile database the estimates read (path, size and modification time),
vtrain's version and a digest of the code and data that compute it (every file of
``vtrain_plugin`` and ``megatron_adapters`` but the CLI and this package), so an edited checkout
never reads an old curve. An entry that cannot be read or does not match its key is ignored,
recomputed and rewritten. The folder and the switch are the trace cache's
(:mod:`vtrain_plugin.capture.disk_cache`): ``$VTRAIN_CACHE_DIR`` (``--cache-dir``), else
``$XDG_CACHE_HOME/vtrain``, else ``~/.cache/vtrain``; ``VTRAIN_NO_CACHE`` (``--no-cache``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from vtrain_plugin.planning.progress import ProgressBar

from profiler.lookup import database_stamp
from vtrain_plugin.capture import disk_cache
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import CurveSpace, ThroughputCurve, compute_curve
from vtrain_plugin.planning.cluster.jobs import Job
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

log = logging.getLogger(__name__)

CURVE_FORMAT = 1
_REPO = Path(__file__).resolve().parents[3]
_CURVE_CODE = ("vtrain_plugin", "megatron_adapters")
_NOT_CURVE_CODE = ("vtrain_plugin/cli/", "vtrain_plugin/planning/cluster/")


class CurveCache:
    """Curves by key, kept in memory and, unless ``directory`` is None, on disk."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = None if directory is None else Path(directory) / "curves"
        self._memory: dict[str, ThroughputCurve] = {}
        self.computed = 0  # curves computed (not found in memory or on disk)

    @classmethod
    def from_environment(cls) -> CurveCache:
        """The cache in the trace cache's folder, or in memory only when that cache is off."""
        return cls(disk_cache.cache_dir() if disk_cache.enabled() else None)

    def curve(self, model: ModelSpec, global_batch_size: int, cluster: ClusterConfig,
              space: CurveSpace) -> ThroughputCurve:
        inputs = curve_inputs(model, global_batch_size, cluster, space)
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        if key in self._memory:
            return self._memory[key]
        curve = self._read(key, inputs)
        if curve is None:
            curve = compute_curve(model, global_batch_size, cluster, space)
            self.computed += 1
            self._write(key, inputs, curve)
        self._memory[key] = curve
        return curve

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.json"

    def _read(self, key: str, inputs: Mapping[str, Any]) -> ThroughputCurve | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry["inputs"] != json.loads(json.dumps(inputs)):
                raise ValueError("its inputs differ from its key's")
            return ThroughputCurve.from_dict(entry["curve"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the unreadable curve cache entry %s (%s); recomputing it", path, exc)
            return None

    def _write(self, key: str, inputs: Mapping[str, Any], curve: ThroughputCurve) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            atomic_write_text(path, json.dumps({"inputs": inputs, "curve": curve.to_dict()}, indent=1) + "\n")
        except OSError as exc:  # a read-only cache costs speed, not results
            log.warning("cannot write the curve cache entry %s: %s", path, exc.strerror or exc)


def curve_inputs(model: ModelSpec, global_batch_size: int, cluster: ClusterConfig,
                 space: CurveSpace) -> dict[str, Any]:
    """Everything a curve depends on, as JSON-ready data (the cache key is its hash)."""
    architecture = get_device(cluster.spec.gpu).architecture
    stack = TrainingSpec(global_batch_size=global_batch_size).stack_for(model, architecture)
    node = {k: val for k, val in cluster.spec.to_dict().items() if k not in ("name", "price_per_gpu_hour_usd")}
    return {"format": CURVE_FORMAT, "vtrain": _version(), "model": replace(model, name="").to_dict(),
            "global_batch_size": global_batch_size, "node": node,
            "counts": {"unit": cluster.unit_gpus, "total": cluster.total_gpus}, "space": space.to_dict(),
            "calibration": calibration_for(cluster.spec.gpu, stack).to_dict()["constants"], "code": _code_digest(),
            "profiles": database_stamp()}


def compute_curves(shapes: Iterable[tuple[ModelSpec, int]], cluster: ClusterConfig, space: CurveSpace,
                   cache: CurveCache, *, progress: bool = False) -> None:
    """Fill ``cache`` with the curve of every (model, global batch) of ``shapes``, with a progress bar."""
    unique = list(dict.fromkeys((replace(model, name=""), batch) for model, batch in shapes))
    names = {(replace(model, name=""), batch): model.name for model, batch in shapes}
    with ProgressBar(unique, desc="throughput curves", unit="curve", file=sys.stderr, disable=not progress) as bar:
        for model, batch in bar:
            bar.set_postfix_str(f"{names[model, batch] or 'model'}, batch {batch}")
            cache.curve(model, batch, cluster, space)


def job_curves(jobs: Iterable[Job], cluster: ClusterConfig, space: CurveSpace, cache: CurveCache, *,
               progress: bool = False) -> dict[str, ThroughputCurve]:
    """The curve of every job, by job name; jobs with the same model and global batch share one."""
    jobs = list(jobs)
    compute_curves([(job.model, job.global_batch_size) for job in jobs], cluster, space, cache, progress=progress)
    return {job.name: cache.curve(replace(job.model, name=""), job.global_batch_size, cluster, space)
            for job in jobs}


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """SHA-256 of the files that compute a curve, by path (see the module doc)."""
    digest = hashlib.sha256()
    for package in _CURVE_CODE:
        for path in sorted((_REPO / package).rglob("*")):
            name = path.relative_to(_REPO).as_posix()
            if path.is_file() and "__pycache__" not in name and not name.startswith(_NOT_CURVE_CODE):
                digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _version() -> str:
    try:
        return metadata.version("vtrain")
    except metadata.PackageNotFoundError:
        return "unknown"
