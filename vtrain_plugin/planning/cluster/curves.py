"""Throughput curves: a job's best plan and iteration time at every GPU count it may receive.

A curve is one plan search (:func:`~vtrain_plugin.planning.search.search`) over every allocatable
count of the cluster, keeping the fastest plan that fits in memory at each count; a count without
such a plan is left out. Curves depend on the model, the global batch and the cluster only, so jobs
that share them share one search, and traces are shared by every search of a model in this process.

The searched space is restricted (:class:`CurveSpace`) because tracing a new chunk shape costs
seconds and a cluster simulation needs one curve per (model, global batch):

- micro-batch 1 and full activation recompute (as the vTrain paper's measured runs), no sequence
  parallelism, no interleaving (1F1B), gradient reduction overlapped with the backward pass, no
  distributed optimizer (the paper's runs; the plan search's ``--dist-opt`` axis is pinned off);
- pipeline stages of at least two layers (one-layer stages are three more chunk shapes to trace);
- tensor parallelism: by default, at each count, the smallest power of two up to a node under which
  a plan fits in memory ("use model parallelism to fit the model, data parallelism to scale":
  Narayanan et al. 2021, takeaway 2; vtrain's own estimates of GPT-3 1.3B to 13B on up to 128 A100
  agree: TP 1 is the fastest there). TP 1 is searched on every count, TP 2 on the counts TP 1
  leaves without a plan, and so on; a size is not traced at all when no valid plan on the counts
  left can hold even the model states (weights, gradients, fp32 main weights and Adam moments, at
  best spread evenly over the TP x PP ranks: a lower bound on any plan's memory). A list of sizes
  instead searches all of them on every count, keeping the fastest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import Recompute
from vtrain_plugin.specs.training import GradReduce, TrainingSpec, model_state_bytes_per_parameter


@dataclass(frozen=True, slots=True, kw_only=True)
class CurvePoint:
    """The fastest plan that fits on ``gpus`` GPUs (its layout is None for hand-made curves)."""

    gpus: int
    iteration_time_ms: float
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    data_parallel: int | None = None
    mfu: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputCurve:
    """Points by ascending GPU count; no points (and a ``reason``) when no plan fits anywhere."""

    points: tuple[CurvePoint, ...] = ()
    reason: str = ""
    _seconds: dict[int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = [p.gpus for p in self.points]
        if counts != sorted(set(counts)):
            raise ValueError(f"curve points must have ascending, distinct GPU counts, got {counts}")
        if not self.points and not self.reason:
            raise ValueError("an empty curve needs the reason why no plan fits")
        object.__setattr__(self, "_seconds", {p.gpus: p.iteration_time_ms / 1000 for p in self.points})

    @classmethod
    def from_seconds(cls, seconds_per_iteration: Mapping[int, float]) -> ThroughputCurve:
        """A hand-made curve: GPU count -> seconds per iteration."""
        return cls(points=tuple(CurvePoint(gpus=n, iteration_time_ms=s * 1000)
                                for n, s in sorted(seconds_per_iteration.items())))

    @property
    def fits(self) -> bool:
        return bool(self.points)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(self._seconds)

    @property
    def min_gpus(self) -> int:
        return self.points[0].gpus

    def iteration_s(self, gpus: int) -> float:
        """Seconds per iteration on ``gpus`` GPUs; a count without a plan is a KeyError."""
        return self._seconds[gpus]

    def point(self, gpus: int) -> CurvePoint:
        return next(p for p in self.points if p.gpus == gpus)

    def efficient_counts(self) -> tuple[int, ...]:
        """The counts faster than every smaller count: more GPUs elsewhere buy nothing."""
        out, best = [], math.inf
        for p in self.points:
            if p.iteration_time_ms < best:
                out.append(p.gpus)
                best = p.iteration_time_ms
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"points": [asdict(p) for p in self.points],
                "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThroughputCurve:
        return cls(points=tuple(CurvePoint(**p) for p in data["points"]), reason=str(data["reason"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveSpace:
    """The plans a curve searches (see the module doc); ``tensor_parallel`` None is the automatic
    choice of one size per model."""

    tensor_parallel: tuple[int, ...] | None = None
    micro_batch_size: int = 1
    recompute: Recompute = Recompute.FULL
    min_layers_per_stage: int = 2

    def __post_init__(self) -> None:
        if self.tensor_parallel is not None:
            tps = tuple(sorted({v.positive_int("curve tensor_parallel", t) for t in self.tensor_parallel}))
            if not tps:
                raise ConfigError("curve tensor_parallel: give at least one size, or None for the automatic one")
            object.__setattr__(self, "tensor_parallel", tps)
        v.positive_int("curve micro_batch_size", self.micro_batch_size)
        object.__setattr__(self, "recompute", Recompute(
            v.one_of("curve recompute", str(self.recompute), [r.value for r in Recompute])))
        v.positive_int("curve min_layers_per_stage", self.min_layers_per_stage)

    def search_space(self, model: ModelSpec, tensor_parallel: tuple[int, ...]) -> SearchSpace:
        layers = model.num_layers
        stages = tuple(p for p in range(1, layers + 1) if layers % p == 0 and layers // p >= self.min_layers_per_stage)
        return SearchSpace(tensor_parallel=tensor_parallel, pipeline_parallel=stages or (1,),
                           micro_batch_size=(self.micro_batch_size,), virtual_pipeline=(1,),
                           sequence_parallel=(False,), recompute=(self.recompute,),
                           grad_reduce=(GradReduce.OVERLAP,), distributed_optimizer=(False,))

    def tensor_parallel_trials(self, gpus_per_node: int) -> list[tuple[int, ...]]:
        """The TP sizes searched in turn, each on the counts still without a plan (see the module doc)."""
        if self.tensor_parallel is not None:
            return [self.tensor_parallel]
        return [(1 << k,) for k in range(gpus_per_node.bit_length()) if 1 << k <= gpus_per_node]

    def to_dict(self) -> dict[str, Any]:
        return {"tensor_parallel": None if self.tensor_parallel is None else list(self.tensor_parallel),
                "micro_batch_size": self.micro_batch_size, "recompute": self.recompute.value,
                "min_layers_per_stage": self.min_layers_per_stage}


def compute_curve(model: ModelSpec, global_batch_size: int, cluster: ClusterConfig,
                  space: CurveSpace) -> ThroughputCurve:
    """The curve of ``model`` at ``global_batch_size`` on every allocatable count of ``cluster``."""
    points: dict[int, CurvePoint] = {}
    reasons = []
    for tps in space.tensor_parallel_trials(cluster.spec.gpus_per_node):
        label = f"TP {','.join(map(str, tps))}"
        search_space = space.search_space(model, tps)
        left = [n for n in cluster.allocatable_counts if n not in points]
        try:
            counts = _plausible_counts(model, global_batch_size, cluster, search_space, left)
        except ConfigError as exc:  # no valid plan at all on these counts
            reasons.append(f"{label}: {exc}")
            continue
        if not counts:
            reasons.append(f"{label}: the model states alone overflow a GPU in every valid plan")
            continue
        table = search(model, cluster=cluster.spec, global_batch_size=global_batch_size, gpus=counts,
                       space=search_space, workers=1).table
        fitting = table[table["fits_in_memory"]]
        if fitting.empty:
            reasons.append(f"{label}: none of its {len(table)} plans fits in GPU memory")
            continue
        best = fitting.sort_values(["num_gpus", "iteration_time_ms"], kind="stable").drop_duplicates("num_gpus")
        for row in best.itertuples():
            points[int(row.num_gpus)] = CurvePoint(
                gpus=int(row.num_gpus), iteration_time_ms=float(row.iteration_time_ms),
                tensor_parallel=int(row.tensor_parallel), pipeline_parallel=int(row.pipeline_parallel),
                data_parallel=int(row.data_parallel), mfu=float(row.mfu))
    if points:
        return ThroughputCurve(points=tuple(points[n] for n in sorted(points)))
    return ThroughputCurve(reason=f"no plan fits on {cluster.unit_gpus} to {cluster.total_gpus} GPUs "
                                  f"(micro-batch {space.micro_batch_size}, {space.recompute.value} recompute; "
                                  + "; ".join(reasons) + ")")


def _plausible_counts(model: ModelSpec, global_batch_size: int, cluster: ClusterConfig, space: SearchSpace,
                      counts: list[int]) -> list[int]:
    """The ``counts`` with a valid plan of ``space`` whose model states could fit in one GPU (see the
    module doc); raises ConfigError when no plan is valid."""
    if not counts:
        return []
    training = TrainingSpec(global_batch_size=global_batch_size)
    plans = enumerate_plans(model, space, global_batch_size=global_batch_size, budget=GpuBudget(counts=tuple(counts)),
                            training=training, gpus_per_node=cluster.spec.gpus_per_node).candidates
    state_bytes = model.num_parameters * model_state_bytes_per_parameter(model.dtype, training.grad_dtype(model.dtype))
    capacity = get_device(cluster.spec.gpu).memory_bytes
    return sorted({c.num_gpus for c in plans
                   if state_bytes <= capacity * c.parallel.tensor_parallel * c.parallel.pipeline_parallel})
