"""How one model replica is split and replicated, and the per-rank batch shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs import limits
from vtrain_plugin.specs.model import ModelSpec


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # core attention only (Megatron's --recompute-granularity selective)
    FULL = "full"  # every transformer layer, uniform, one layer per checkpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """How one model replica is split and replicated, and the per-rank batch shape."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    sequence_parallel: bool = False
    virtual_pipeline: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch_size: int = 1
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
            limits.WORLD_SIZE.positive_int(f"parallel.{name}", getattr(self, name))
        limits.WORLD_SIZE.check_derived(
            f"parallel.tensor_parallel ({self.tensor_parallel}) * pipeline_parallel ({self.pipeline_parallel}) "
            f"* data_parallel ({self.data_parallel})", self.world_size)
        limits.NUM_LAYERS.positive_int("parallel.virtual_pipeline", self.virtual_pipeline)
        limits.MICRO_BATCH_SIZE.positive_int("parallel.micro_batch_size", self.micro_batch_size)
        v.boolean("parallel.sequence_parallel", self.sequence_parallel)
        object.__setattr__(self, "recompute", Recompute(
            v.one_of("parallel.recompute", self.recompute, [r.value for r in Recompute])))
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("parallel.sequence_parallel requires tensor_parallel > 1 (got 1)")
        if self.virtual_pipeline > 1 and self.pipeline_parallel == 1:
            raise ConfigError("parallel.virtual_pipeline > 1 requires pipeline_parallel > 1 (got 1)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def num_model_chunks(self) -> int:
        return self.pipeline_parallel * self.virtual_pipeline

    def check_fits(self, model: ModelSpec) -> None:
        """Raise ConfigError at the first of :data:`LAYOUT_RULES` this layout breaks for ``model``."""
        for rule in LAYOUT_RULES:
            if rule.broken(self, model):
                raise ConfigError(rule.message(self, model))
        limits.MICRO_BATCH_TOKENS.check_derived(
            f"micro_batch_size ({self.micro_batch_size}) * seq_length ({model.seq_length})",
            self.micro_batch_size * model.seq_length)

    def layers_per_chunk(self, model: ModelSpec) -> int:
        return model.num_layers // self.num_model_chunks

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute"] = self.recompute.value
        return d


@dataclass(frozen=True, slots=True)
class LayoutRule:
    """A rule a layout keeps to shard a model. ``name`` is the short label the plan search counts
    skipped plans under; ``message`` shows the arithmetic that failed."""

    name: str
    broken: Callable[[ParallelPlan, ModelSpec], bool]
    message: Callable[[ParallelPlan, ModelSpec], str]


def _divides(name: str, divisor: str, dividend: str, get_divisor: Callable[[ParallelPlan], int],
             get_dividend: Callable[[ModelSpec], int], when: Callable[[ParallelPlan], bool] = lambda p: True
             ) -> LayoutRule:
    return LayoutRule(
        name=name,
        broken=lambda p, m: when(p) and get_dividend(m) % get_divisor(p) != 0,
        message=lambda p, m: f"{divisor} ({get_divisor(p)}) must divide {dividend} ({get_dividend(m)})")


# In the order check_fits tests them (and the plan search reports them).
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    _divides("heads % tp", "tensor_parallel_size", "num_attention_heads",
             lambda p: p.tensor_parallel, lambda m: m.num_attention_heads),
    _divides("query groups % tp", "tensor_parallel_size", "num_query_groups",
             lambda p: p.tensor_parallel, lambda m: m.query_groups),
    _divides("ffn % tp", "tensor_parallel_size", "ffn_hidden_size",
             lambda p: p.tensor_parallel, lambda m: m.ffn_size),
    _divides("layers % pp", "pipeline_parallel_size", "num_layers",
             lambda p: p.pipeline_parallel, lambda m: m.num_layers),
    LayoutRule(
        name="layers % (pp*vp)",
        broken=lambda p, m: m.num_layers % p.num_model_chunks != 0,
        message=lambda p, m: (f"pipeline_parallel_size ({p.pipeline_parallel}) * virtual_pipeline "
                              f"({p.virtual_pipeline}) = {p.num_model_chunks} must divide num_layers "
                              f"({m.num_layers})")),
    _divides("seq % tp (sp)", "tensor_parallel_size", "seq_length",
             lambda p: p.tensor_parallel, lambda m: m.seq_length, when=lambda p: p.sequence_parallel),
)
