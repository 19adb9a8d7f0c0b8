"""Measured durations for an estimate: kernels and collectives read from the profile database.

Which profile stands for the run's device (``cluster.gpu``):

- ``cpu``: the fingerprint of this machine's CPU as torch uses it now (CPU model, thread count,
  torch version), exactly; a CPU profile only predicts the CPU it was measured on.
- a GPU preset: the CUDA fingerprints whose device name names that GPU
  (:func:`gpu_name_matches`: "NVIDIA H100 80GB HBM3" is an ``h100-sxm``, "NVIDIA A100-SXM4-40GB"
  an ``a100-sxm4-40gb``). When several match (other torch or CUDA versions, other machines),
  this machine's own fingerprint wins; otherwise the one with the most of the run's kernels (for
  collectives: the most rows), ties broken by label.

A database file that does not exist means "nothing measured" (it is not created by reading); a
file that is corrupt or belongs to something else raises :class:`ProfileError`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from profiler.db import ProfileDB, default_db_path
from profiler.fingerprint import DeviceFingerprint, DeviceKind, current_fingerprint
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import CollectiveKind, KernelKey, OpGraph
from vtrain_plugin.hardware.devices import gpu_name_matches
from vtrain_plugin.hardware.nccl import NcclTable
from vtrain_plugin.specs.cluster import ClusterSpec

CPU_DEVICE = "cpu"
# Measured tables of the benchmark's kinds stand for these kinds of the graph (a send/recv pair for both).
_TABLE_KINDS: dict[CollectiveKind, tuple[CollectiveKind, ...]] = {
    CollectiveKind.ALL_REDUCE: (CollectiveKind.ALL_REDUCE,),
    CollectiveKind.ALL_GATHER: (CollectiveKind.ALL_GATHER,),
    CollectiveKind.REDUCE_SCATTER: (CollectiveKind.REDUCE_SCATTER,),
    CollectiveKind.ALL_TO_ALL: (CollectiveKind.ALL_TO_ALL,),
    CollectiveKind.SEND: (CollectiveKind.SEND, CollectiveKind.RECV),
}


def open_profile_db(db_path: str | os.PathLike | None = None) -> ProfileDB | None:
    """The database at ``db_path`` (else ``$VTRAIN_PROFILE_DB``, else the user cache); None if absent."""
    path = _resolved(db_path)
    if not path.exists():
        return None
    return ProfileDB.open(path)


def measured_for_graph(graph: OpGraph, cluster: ClusterSpec, *, db_path: str | os.PathLike | None = None
                       ) -> tuple[dict[KernelKey, float], dict[tuple[CollectiveKind, int], NcclTable]]:
    """The measured kernels of ``graph`` and collective tables of ``cluster`` (both empty when the
    database does not exist): what every estimate reads unless told otherwise."""
    if not _resolved(db_path).exists():  # the common case, a stat and no import of torch
        return {}, {}
    return (measured_durations(graph.unique_kernels(), cluster.gpu, db_path=db_path),
            measured_comm_tables(cluster, db_path=db_path))


def database_stamp(db_path: str | os.PathLike | None = None) -> dict[str, object] | None:
    """Which database estimates read, and which state of it: its path, size and modification time
    (None when it does not exist); a cache of results computed from estimates keys on it."""
    path = _resolved(db_path)
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return {"path": str(path.resolve()), "nbytes": info.st_size, "mtime_ns": info.st_mtime_ns}


def _resolved(db_path: str | os.PathLike | None) -> Path:
    return Path(db_path).expanduser() if db_path is not None else default_db_path()


def candidate_fingerprints(db: ProfileDB, gpu: str) -> list[DeviceFingerprint]:
    """Fingerprints in ``db`` that stand for device preset ``gpu``, this machine's own first."""
    if gpu == CPU_DEVICE:
        local = current_fingerprint(CPU_DEVICE)
        return [fp for fp in db.fingerprints() if fp.id == local.id]
    found = [fp for fp in db.fingerprints()
             if fp.kind is DeviceKind.CUDA and gpu_name_matches(gpu, fp.device_name)]
    local_id = _local_cuda_id()
    return sorted(found, key=lambda fp: (fp.id != local_id, fp.label))


def measured_durations(keys: Iterable[KernelKey], gpu: str, *,
                       db_path: str | os.PathLike | None = None) -> dict[KernelKey, float]:
    """Measured durations (ns) of the kernels ``keys`` on device preset ``gpu``; empty when none are profiled."""
    with _opened(db_path) as db:
        if db is None:
            return {}
        candidates = candidate_fingerprints(db, gpu)
        if not candidates:
            return {}
        keys = list(keys)
        tables = [db.get_kernels(fp, keys) for fp in candidates]
    return max(tables, key=len)


def measured_comm_tables(cluster: ClusterSpec, *, db_path: str | os.PathLike | None = None) -> dict[
        tuple[CollectiveKind, int], NcclTable]:
    """Measured collective tables for groups inside one node of ``cluster``, by (kind, group size).

    Backend: gloo for the CPU, NCCL for GPUs. Empty when nothing matches.
    """
    backend = "gloo" if cluster.gpu == CPU_DEVICE else "nccl"
    sizes = range(2, cluster.gpus_per_node + 1)
    with _opened(db_path) as db:
        if db is None:
            return {}
        best: dict[tuple[CollectiveKind, int], NcclTable] = {}
        for fp in candidate_fingerprints(db, cluster.gpu):
            tables = _comm_tables(db, fp, backend, sizes)
            if sum(len(t.sizes_nbytes) for t in tables.values()) > sum(len(t.sizes_nbytes) for t in best.values()):
                best = tables
    return best


def _comm_tables(db: ProfileDB, fp: DeviceFingerprint, backend: str,
                 sizes: Iterable[int]) -> dict[tuple[CollectiveKind, int], NcclTable]:
    tables: dict[tuple[CollectiveKind, int], NcclTable] = {}
    for group_size in sizes:
        for bench_kind, kinds in _TABLE_KINDS.items():
            rows = [(n, t) for n, t in db.comm_table(fp, bench_kind, group_size, backend) if n > 0]
            if not rows:
                continue
            table = NcclTable(num_gpus=group_size, sizes_nbytes=tuple(n for n, _ in rows),
                              times_ns=tuple(t for _, t in rows))
            for kind in kinds:
                tables[(kind, group_size)] = table
    return tables


@contextlib.contextmanager
def _opened(db_path: str | os.PathLike | None) -> Iterator[ProfileDB | None]:
    db = open_profile_db(db_path)
    try:
        yield db
    finally:
        if db is not None:
            db.close()


def _local_cuda_id() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return current_fingerprint("cuda").id
    except ProfileError:
        return None
