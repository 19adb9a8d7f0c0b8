"""Measuring collectives on the local node: the tables the comm model interpolates.

``benchmark_collectives`` spawns one process per rank (``torch.multiprocessing``, spawn), joined
through a TCP store the parent serves on 127.0.0.1 (port chosen by the OS); gloo and NCCL
bootstrap are pinned to the loopback interface, so nothing leaves the machine. For every group
size (powers of two up to the world size, and the world size) it times each collective kind for
message sizes that are powers of two, on ranks ``0 .. group_size - 1``.

``nbytes`` is the size of the whole buffer, as nccl-tests counts it: all_reduce the reduced
buffer; all_gather the gathered output (each rank contributes ``nbytes / group_size``);
reduce_scatter the input (each rank keeps ``nbytes / group_size``); all_to_all each rank's
send buffer; send (a send/recv pair) the message sent one way (ranks 0 and 1 only, so group size 2). Tensors
are float32; when ``group_size`` does not divide the element count the row records the bytes
actually moved.

Timing (rank 0): after a barrier, a window of ``k`` back-to-back operations (``k`` from 20 for
small messages down to 1, so launch skew is amortized) timed by
:func:`profiler.device_timing.elapsed_ns` (CUDA events on GPU, ``time.perf_counter_ns`` on CPU);
the duration is the median over windows of the per-operation time. send is timed as a
ping-pong, one way being half a round trip. All five kinds work with gloo in torch 2.13; a
kind the backend rejects is reported in ``unsupported`` with the backend's reason, never
emulated.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from profiler.db import ProfileDB
from profiler.device_timing import elapsed_ns
from profiler.fingerprint import DeviceFingerprint, current_fingerprint
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import CollectiveKind
from vtrain_plugin.core.units import GIB, KIB

CPU_DEFAULT_MAX_NBYTES = 64 << 20
_WINDOWS = 5
_WINDOW_NBYTES = 16 << 20  # a timing window moves about this much (at most 20 operations)
_ELEMENT_NBYTES = 4  # float32


# The collectives benchmarked; SEND stands for a send/recv pair (the time of one transfer).
BENCHMARKED: tuple[CollectiveKind, ...] = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER,
                                           CollectiveKind.REDUCE_SCATTER, CollectiveKind.SEND,
                                           CollectiveKind.ALL_TO_ALL)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommRow:
    kind: CollectiveKind
    group_size: int
    backend: str
    nbytes: int
    duration_ns: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsupported:
    kind: CollectiveKind
    group_size: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CommBenchResult:
    rows: tuple[CommRow, ...]
    unsupported: tuple[Unsupported, ...] = ()


def message_sizes(min_nbytes: int = KIB, max_nbytes: int = GIB) -> list[int]:
    """Powers of two from ``min_nbytes`` up to ``max_nbytes`` (both rounded to powers of two)."""
    if not 1 <= min_nbytes <= max_nbytes:
        raise ProfileError(f"message sizes need 1 <= min_nbytes ({min_nbytes}) <= max_nbytes ({max_nbytes})")
    sizes, n = [], 1 << (min_nbytes - 1).bit_length()
    while n <= max_nbytes:
        sizes.append(n)
        n *= 2
    return sizes


def group_sizes_for(world_size: int) -> list[int]:
    """Powers of two from 2 up to ``world_size``, plus ``world_size`` itself."""
    sizes = [g for g in (1 << i for i in range(1, world_size.bit_length())) if g <= world_size]
    return sizes if world_size in sizes else [*sizes, world_size]


def benchmark_collectives(device: str = "cuda", *, kinds: Sequence[str] = BENCHMARKED,
                          min_nbytes: int = KIB, max_nbytes: int | None = None, world_size: int | None = None,
                          backend: str | None = None, db: ProfileDB | None = None,
                          fingerprint: DeviceFingerprint | None = None, timeout_s: float = 600.0) -> CommBenchResult:
    """Measure ``kinds`` on this node and store the rows in ``db`` (when given) under ``fingerprint``.

    ``world_size`` defaults to every GPU of the node for "cuda" and to 2..4 processes (by CPU
    count) for "cpu"; ``backend`` to nccl for cuda and gloo for cpu; ``max_nbytes`` to 1 GiB on
    cuda and 64 MiB on cpu.
    """
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ProfileError(f"collective benchmark device {device!r} must be 'cpu' or 'cuda'")
    try:
        bench_kinds = [CollectiveKind(k) for k in kinds]
        if not set(bench_kinds) <= set(BENCHMARKED):
            raise ValueError
    except ValueError:
        raise ProfileError(f"collective kinds {list(kinds)} must be among {[k.value for k in BENCHMARKED]}") from None
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    if world_size is None:
        world_size = torch.cuda.device_count() if device_type == "cuda" else min(4, max(2, os.cpu_count() or 2))
    if world_size < 2:
        raise ProfileError(f"collective benchmark world_size ({world_size}) must be >= 2")
    if device_type == "cuda" and world_size > torch.cuda.device_count():
        raise ProfileError(f"collective benchmark world_size ({world_size}) exceeds the "
                           f"{torch.cuda.device_count()} visible GPUs")
    sizes = message_sizes(min_nbytes, max_nbytes or (GIB if device_type == "cuda" else CPU_DEFAULT_MAX_NBYTES))
    fp = fingerprint or current_fingerprint(device)

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    with tempfile.TemporaryDirectory(prefix="vtrain-comm-") as tmp:
        result_path = Path(tmp) / "rows.json"
        plan = {"world_size": world_size, "port": store.port, "backend": backend, "device_type": device_type,
                "kinds": [k.value for k in bench_kinds], "sizes": sizes, "timeout_s": timeout_s,
                "result_path": str(result_path)}
        try:
            _run_ranks(plan, world_size)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            raise ProfileError(f"collective benchmark ({backend}, {world_size} ranks) failed: {last}") from None
        report = json.loads(result_path.read_text())
    rows = tuple(CommRow(kind=CollectiveKind(r["kind"]), group_size=r["group_size"], backend=backend,
                         nbytes=r["nbytes"], duration_ns=r["duration_ns"]) for r in report["rows"])
    unsupported = tuple(Unsupported(kind=CollectiveKind(u["kind"]), group_size=u["group_size"], reason=u["reason"])
                        for u in report["unsupported"])
    if db is not None:
        for row in rows:
            db.put_comm(fp, row.kind, row.group_size, row.backend, row.nbytes, row.duration_ns)
    return CommBenchResult(rows=rows, unsupported=unsupported)


def _run_ranks(plan: dict[str, Any], world_size: int) -> None:
    """``mp.spawn`` of the ranks, none of which outlives this call or sees Ctrl-C: they start with
    SIGINT ignored (a terminal sends it to the whole process group; a rank interrupted while it
    imports torch would print a traceback; an ignored disposition survives the exec of a spawned
    interpreter, which then keeps it, where a blocked mask does not reliably), are killed when the
    parent is interrupted, and are daemons, so that even an interruption while they start leaves
    none behind at exit. The parent ignores SIGINT only while it creates them."""
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ranks = mp.start_processes(_worker, args=(plan,), nprocs=world_size, join=False, daemon=True,
                                   start_method="spawn")
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        while not ranks.join():
            pass
    except KeyboardInterrupt:
        for rank in ranks.processes:
            rank.kill()
            rank.join()
        raise


# ---- inside each spawned rank -----------------------------------------------------------------------

def _worker(rank: int, plan: dict[str, Any]) -> None:
    loopback = _loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    os.environ["NCCL_SOCKET_IFNAME"] = loopback
    world_size, device_type = plan["world_size"], plan["device_type"]
    timeout = datetime.timedelta(seconds=plan["timeout_s"])
    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", plan["port"], is_master=False, timeout=timeout)
    dist.init_process_group(plan["backend"], store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=dev if device_type == "cuda" else None)
    try:
        rows, unsupported = [], []
        for g in group_sizes_for(world_size):
            group = dist.new_group(list(range(g)))
            for kind in map(CollectiveKind, plan["kinds"]):
                if rank >= g or (kind is CollectiveKind.SEND and g != 2):
                    continue
                try:
                    for nbytes in plan["sizes"]:
                        moved, duration_ns = _measure(kind, nbytes, g, rank, group, dev)
                        rows.append({"kind": kind.value, "group_size": g, "nbytes": moved,
                                     "duration_ns": duration_ns})
                except (RuntimeError, ValueError, NotImplementedError) as exc:
                    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    unsupported.append({"kind": kind.value, "group_size": g, "reason": reason})
            dist.barrier()
        if rank == 0:
            Path(plan["result_path"]).write_text(json.dumps({"rows": rows, "unsupported": unsupported}))
    finally:
        dist.destroy_process_group()


def _measure(kind: CollectiveKind, nbytes: int, g: int, rank: int, group: Any,
             dev: torch.device) -> tuple[int, float]:
    per_rank = max(1, nbytes // _ELEMENT_NBYTES // g)
    full = per_rank * g
    if kind is CollectiveKind.ALL_REDUCE or kind is CollectiveKind.SEND:
        full = max(1, nbytes // _ELEMENT_NBYTES)
    op = _operation(kind, full, per_rank, rank, group, dev)
    k = max(1, min(20, _WINDOW_NBYTES // max(nbytes, 1)))
    _window(op, k, group, dev)  # warm-up: connections, communicators, allocator
    per_op_ns = [_window(op, k, group, dev) / k for _ in range(_WINDOWS)]
    if kind is CollectiveKind.SEND:
        per_op_ns = [t / 2 for t in per_op_ns]  # a round trip is two one-way messages
    return full * _ELEMENT_NBYTES, float(statistics.median(per_op_ns))


def _operation(kind: CollectiveKind, full: int, per_rank: int, rank: int, group: Any,
               dev: torch.device) -> Callable[[], None]:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if kind is CollectiveKind.ALL_REDUCE:
        buf = torch.ones(full, device=dev)
        return lambda: dist.all_reduce(buf, group=group)
    if kind is CollectiveKind.ALL_GATHER:
        inp, out = torch.ones(per_rank, device=dev), torch.empty(full, device=dev)
        return lambda: gather(out, inp, group=group)
    if kind is CollectiveKind.REDUCE_SCATTER:
        inp, out = torch.ones(full, device=dev), torch.empty(per_rank, device=dev)
        return lambda: scatter(out, inp, group=group)
    if kind is CollectiveKind.ALL_TO_ALL:
        inp, out = torch.ones(full, device=dev), torch.empty(full, device=dev)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    buf = torch.ones(full, device=dev)
    if rank == 0:
        return lambda: (dist.send(buf, 1), dist.recv(buf, 1))
    return lambda: (dist.recv(buf, 0), dist.send(buf, 0))


def _window(op: Callable[[], None], k: int, group: Any, dev: torch.device) -> float:
    """Nanoseconds that ``k`` back-to-back ``op`` calls take on this rank, after a barrier."""
    dist.barrier(group=group)
    return elapsed_ns(op, k, dev)


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    raise ProfileError("collective benchmark needs a loopback network interface (none named 'lo*' found)")
