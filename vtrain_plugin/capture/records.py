"""What the recorder writes down per op or collective: plain data, readable without importing torch
(folding turns records into graph nodes, and a traced graph read back from the disk cache is
assembled without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass

from vtrain_plugin.core.graph import CollectiveKind, KernelKey, Phase


@dataclass(frozen=True, slots=True)
class OpRecord:
    key: KernelKey
    phase: Phase
    module: str
    output_shapes: tuple[tuple[int, ...], ...]
    launches_kernel: bool
    flops: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    kind: CollectiveKind
    nbytes: int
    group_name: str
    group_size: int
    phase: Phase
    module: str
    dtype: str


Record = OpRecord | CollectiveRecord
