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
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from profiler.db import ProfileDB, default_db_path
from profiler.fingerprint import DeviceFingerprint, DeviceKind, current_fingerprint
from vtrain_plugin.comm.nccl_table import NcclTable
from vtrain_plugin.config import RunConfig
from vtrain_plugin.errors import ProfileError
from vtrain_plugin.graph import CollectiveKind, KernelKey

CPU_DEVICE = "cpu"
_MEMORY_TOKEN = re.compile(r"^\d+gb$")
_NOT_SXM = ("pcie", "nvl")
# Collective kinds of the benchmark (profiler.comm_bench.BenchKind values) -> kinds of the graph.
_BENCH_KINDS: dict[str, tuple[CollectiveKind, ...]] = {
    "all_reduce": (CollectiveKind.ALL_REDUCE,),
    "all_gather": (CollectiveKind.ALL_GATHER,),
    "reduce_scatter": (CollectiveKind.REDUCE_SCATTER,),
    "all_to_all": (CollectiveKind.ALL_TO_ALL,),
    "send_recv": (CollectiveKind.SEND, CollectiveKind.RECV),
}


def gpu_name_matches(preset: str, device_name: str) -> bool:
    """Whether a CUDA device called ``device_name`` is an instance of GPU preset ``preset``.

    The preset's family ("a100", "h100", ...) must be a word of the name (words split at spaces,
    dashes and underscores, case-insensitive); a memory size in both ("40gb" vs "80gb") must
    agree; and a PCIe or NVL card is not an SXM preset.
    """
    family, *details = preset.casefold().split("-")
    words = set(re.split(r"[\s_\-]+", device_name.casefold()))
    if family not in words:
        return False
    if any(d.startswith("sxm") for d in details) and any(w in _NOT_SXM for w in words):
        return False
    preset_memory = {d for d in details if _MEMORY_TOKEN.match(d)}
    name_memory = {w for w in words if _MEMORY_TOKEN.match(w)}
    return not (preset_memory and name_memory and not preset_memory & name_memory)


def open_profile_db(db_path: str | os.PathLike | None = None) -> ProfileDB | None:
    """The database at ``db_path`` (else ``$VTRAIN_PROFILE_DB``, else the user cache); None if absent."""
    path = Path(db_path).expanduser() if db_path is not None else default_db_path()
    if not path.exists():
        return None
    return ProfileDB.open(path)


def candidate_fingerprints(db: ProfileDB, gpu: str) -> list[DeviceFingerprint]:
    """Fingerprints in ``db`` that stand for device preset ``gpu``, this machine's own first."""
    if gpu == CPU_DEVICE:
        local = current_fingerprint(CPU_DEVICE)
        return [fp for fp in db.fingerprints() if fp.id == local.id]
    found = [fp for fp in db.fingerprints()
             if fp.kind is DeviceKind.CUDA and gpu_name_matches(gpu, fp.device_name)]
    local_id = _local_cuda_id()
    return sorted(found, key=lambda fp: (fp.id != local_id, fp.label))


def measured_durations(run: RunConfig, *, db_path: str | os.PathLike | None = None) -> dict[KernelKey, float]:
    """Measured durations (ns) of ``run``'s kernels on its cluster's device; empty when none are profiled."""
    from vtrain_plugin.tracer import trace

    with _opened(db_path) as db:
        if db is None:
            return {}
        candidates = candidate_fingerprints(db, run.cluster.gpu)
        if not candidates:
            return {}
        keys = list(trace(run.model, run.parallel).unique_kernels())
        tables = [db.get_kernels(fp, keys) for fp in candidates]
    return max(tables, key=len)


def measured_comm_tables(run: RunConfig, *, db_path: str | os.PathLike | None = None) -> dict[
        tuple[CollectiveKind, int], NcclTable]:
    """Measured collective tables for groups inside one node of ``run``'s cluster, by (kind, group size).

    Backend: gloo for the CPU, NCCL for GPUs. Empty when nothing matches.
    """
    backend = "gloo" if run.cluster.gpu == CPU_DEVICE else "nccl"
    sizes = range(2, run.cluster.gpus_per_node + 1)
    with _opened(db_path) as db:
        if db is None:
            return {}
        best: dict[tuple[CollectiveKind, int], NcclTable] = {}
        for fp in candidate_fingerprints(db, run.cluster.gpu):
            tables = _comm_tables(db, fp, backend, sizes)
            if sum(len(t.sizes_nbytes) for t in tables.values()) > sum(len(t.sizes_nbytes) for t in best.values()):
                best = tables
    return best


def _comm_tables(db: ProfileDB, fp: DeviceFingerprint, backend: str,
                 sizes: Iterable[int]) -> dict[tuple[CollectiveKind, int], NcclTable]:
    tables: dict[tuple[CollectiveKind, int], NcclTable] = {}
    for group_size in sizes:
        for bench_kind, kinds in _BENCH_KINDS.items():
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
