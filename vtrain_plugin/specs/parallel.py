"""How one model replica is split and replicated, and the per-rank batch shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
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
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "virtual_pipeline",
                     "micro_batch_size"):
            v.positive_int(f"parallel.{name}", getattr(self, name))
        v.boolean("parallel.sequence_parallel", self.sequence_parallel)
        object.__setattr__(self, "recompute", Recompute(
            v.one_of("parallel.recompute", str(self.recompute), [r.value for r in Recompute])))
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
        """Raise ConfigError when this layout cannot shard ``model``."""
        tp = self.tensor_parallel
        v.divides("tensor_parallel_size", tp, "num_attention_heads", model.num_attention_heads)
        v.divides("tensor_parallel_size", tp, "num_query_groups", model.query_groups)
        v.divides("tensor_parallel_size", tp, "ffn_hidden_size", model.ffn_size)
        chunks = self.num_model_chunks
        if model.num_layers % chunks:
            if self.virtual_pipeline > 1:
                raise ConfigError(
                    f"pipeline_parallel_size ({self.pipeline_parallel}) * virtual_pipeline "
                    f"({self.virtual_pipeline}) = {chunks} must divide num_layers ({model.num_layers})")
            raise ConfigError(
                f"pipeline_parallel_size ({self.pipeline_parallel}) must divide num_layers ({model.num_layers})")
        if self.sequence_parallel:
            v.divides("tensor_parallel_size", tp, "seq_length", model.seq_length)

    def layers_per_chunk(self, model: ModelSpec) -> int:
        return model.num_layers // self.num_model_chunks

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute"] = self.recompute.value
        return d
