"""What is trained and how it is laid out: the model spec and the parallel plan.

Both are frozen dataclasses validated on construction; derived values are properties. The cluster
(hardware) lives in :mod:`vtrain_plugin.cluster`, the training schedule in
:mod:`vtrain_plugin.training`: application, execution and system stay separate inputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin import _validate as v
from vtrain_plugin.errors import ConfigError


class Family(StrEnum):
    GPT = "gpt"  # LayerNorm, GeLU MLP, learned absolute positions, multi-head attention
    LLAMA = "llama"  # RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # core attention only (Megatron's --recompute-granularity selective)
    FULL = "full"  # every transformer layer, uniform, one layer per checkpoint


class Dtype(StrEnum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"

    @property
    def nbytes(self) -> int:
        return 4 if self is Dtype.FP32 else 2

    @property
    def torch_name(self) -> str:
        return {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[self.value]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, described by its dimensions (megatron-core GPTModel)."""

    family: Family = Family.GPT
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int = 50257
    ffn_hidden_size: int | None = None  # default: 4h (GPT), Llama's 2/3*4h rounded to 256
    num_query_groups: int | None = None  # default: num_attention_heads (multi-head attention)
    tied_embeddings: bool | None = None  # default: True for GPT, False for Llama
    dtype: Dtype = Dtype.FP16
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", Family(v.one_of("model.family", str(self.family), [f.value for f in Family])))
        object.__setattr__(self, "dtype", Dtype(v.one_of("model.dtype", str(self.dtype), [d.value for d in Dtype])))
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            v.positive_int(f"model.{name}", getattr(self, name))
        if self.ffn_hidden_size is not None:
            v.positive_int("model.ffn_hidden_size", self.ffn_hidden_size)
        if self.num_query_groups is not None:
            v.positive_int("model.num_query_groups", self.num_query_groups)
            v.divides("model.num_query_groups", self.num_query_groups,
                      "model.num_attention_heads", self.num_attention_heads)
        if self.tied_embeddings is not None:
            v.boolean("model.tied_embeddings", self.tied_embeddings)
        v.divides("model.num_attention_heads", self.num_attention_heads,
                  "model.hidden_size", self.hidden_size)

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.family is Family.LLAMA:
            raw = int(2 * 4 * self.hidden_size / 3)
            return 256 * ((raw + 255) // 256)
        return 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def tied(self) -> bool:
        if self.tied_embeddings is not None:
            return self.tied_embeddings
        return self.family is Family.GPT

    def padded_vocab_size(self, tensor_parallel: int, divisible_by: int = 128) -> int:
        """Megatron-LM pads the vocabulary to a multiple of ``divisible_by * tensor_parallel``."""
        multiple = divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole (unsharded) model, embeddings included."""
        h, f = self.hidden_size, self.ffn_size
        kv = 2 * self.query_groups * self.head_dim
        if self.family is Family.GPT:
            attn = h * (h + kv) + (h + kv) + h * h + h
            mlp = h * f + f + f * h + h
            norms = 2 * 2 * h
            positions = self.seq_length * h
            final_norm = 2 * h
        else:
            attn = h * (h + kv) + h * h
            mlp = h * 2 * f + f * h
            norms = 2 * h
            positions = 0
            final_norm = h
        embed = self.vocab_size * h * (1 if self.tied else 2)
        return self.num_layers * (attn + mlp + norms) + embed + positions + final_norm

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["family"] = self.family.value
        d["dtype"] = self.dtype.value
        return d


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
