"""Measured NCCL all-reduce tables (time versus message size, for N GPUs of one node).

A table set is a folder ``vtrain_plugin/hardware/data/nccl/<name>/`` holding one file per group size,
``AR_GPU{N}_*``, in the nccl-tests CSV layout published with vTrain::

    size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)

with two repetitions per size; the time used is their mean. Files are read from the installed
package (never the working directory) and parsed once per process.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError

_HEADER = "size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)"
_FILE_RE = re.compile(r"AR_GPU(\d+)_")


@dataclass(frozen=True, slots=True, kw_only=True)
class NcclTable:
    """All-reduce time of ``num_gpus`` GPUs of one node at strictly increasing message sizes."""

    num_gpus: int
    sizes_nbytes: tuple[int, ...]
    times_ns: tuple[float, ...]

    def __post_init__(self) -> None:
        v.positive_int("nccl_table.num_gpus", self.num_gpus)
        if not self.sizes_nbytes or len(self.sizes_nbytes) != len(self.times_ns):
            raise ConfigError("nccl_table needs as many times as sizes, at least one")
        if any(b <= a for a, b in zip(self.sizes_nbytes, self.sizes_nbytes[1:])) or self.sizes_nbytes[0] <= 0:
            raise ConfigError("nccl_table.sizes_nbytes must be positive and strictly increasing")

    @property
    def zero_byte_ns(self) -> float:
        """The all-reduce's fixed cost: the first two entries' line extrapolated to zero bytes
        (clamped to ``[0, first time]``). What NCCL spends per collective on these GPUs whatever the
        size: the kernel launch, the channels' setup and the ring's intra-node steps at their
        measured (not nominal) latency."""
        sizes, times = self.sizes_nbytes, self.times_ns
        if len(sizes) == 1:
            return times[0]
        slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
        return min(max(times[0] - slope * sizes[0], 0.0), times[0])

    def time_ns(self, nbytes: int, *, latency_floor_ns: float = 0.0) -> float:
        """Time of an all-reduce of ``nbytes``.

        Inside the table: linear in time between the two neighbouring sizes (exact at table points).
        Above it: the last entry's algorithm bandwidth (time proportional to size). Below it: linear
        from ``latency_floor_ns`` at zero bytes to the first entry, so tiny messages keep a latency
        instead of being scaled down to nothing.
        """
        sizes, times = self.sizes_nbytes, self.times_ns
        if nbytes <= 0:
            return 0.0
        if nbytes >= sizes[-1]:
            return times[-1] * nbytes / sizes[-1]
        if nbytes <= sizes[0]:
            floor = min(latency_floor_ns, times[0])
            return floor + (times[0] - floor) * nbytes / sizes[0]
        i = bisect.bisect_right(sizes, nbytes)
        s0, s1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)


def parse_table(text: str, *, num_gpus: int, where: str) -> NcclTable:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or lines[0] != _HEADER:
        raise ConfigError(f"{where}: first line must be the header {_HEADER!r}")
    sizes: list[int] = []
    times: list[float] = []
    for lineno, line in enumerate(lines[1:], start=2):
        cols = line.split(",")
        if len(cols) != 7:
            raise ConfigError(f"{where}:{lineno}: expected 7 comma-separated columns, got {len(cols)}")
        try:
            sizes.append(int(cols[0]))
            times.append((float(cols[3]) + float(cols[5])) / 2.0)
        except ValueError:
            raise ConfigError(f"{where}:{lineno}: size and times must be numbers, got {line!r}") from None
    try:
        return NcclTable(num_gpus=num_gpus, sizes_nbytes=tuple(sizes), times_ns=tuple(times))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _root() -> Path:
    return Path(__file__).with_name("data") / "nccl"


@lru_cache(maxsize=None)
def available_table_sets() -> tuple[str, ...]:
    root = _root()
    if not root.is_dir():
        return ()
    return tuple(sorted(p.name for p in root.iterdir() if p.is_dir()))


@lru_cache(maxsize=None)
def load_table_set(name: str) -> Mapping[int, NcclTable]:
    """The tables of set ``name`` keyed by group size (GPUs of one node)."""
    v.one_of("cluster.nccl_tables", name, available_table_sets())
    tables: dict[int, NcclTable] = {}
    for path in _root().joinpath(name).iterdir():
        match = _FILE_RE.match(path.name)
        if match is None:
            continue
        n = int(match.group(1))
        if n in tables:
            raise ConfigError(f"nccl table set {name!r} has two tables for {n} GPUs")
        tables[n] = parse_table(path.read_text(), num_gpus=n, where=f"nccl table {name}/{path.name}")
    return MappingProxyType(tables)
