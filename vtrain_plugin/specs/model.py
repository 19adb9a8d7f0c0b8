"""What is trained: the model spec (a megatron-core GPTModel described by its dimensions).

A frozen dataclass validated on construction; derived values are properties. How it is laid out
(:mod:`vtrain_plugin.specs.parallel`), run (:mod:`vtrain_plugin.specs.training`) and on what
(:mod:`vtrain_plugin.specs.cluster`) stay separate inputs: application, execution and system.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.dtypes import MODEL_DTYPES, Dtype
from vtrain_plugin.specs import limits


class Family(StrEnum):
    GPT = "gpt"  # LayerNorm, GeLU MLP, learned absolute positions, multi-head attention
    LLAMA = "llama"  # RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention


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
        object.__setattr__(self, "family", Family(v.one_of("model.family", self.family, [f.value for f in Family])))
        object.__setattr__(self, "dtype", Dtype(v.one_of("model.dtype", self.dtype, [d.value for d in MODEL_DTYPES])))
        for name, limit in (("num_layers", limits.NUM_LAYERS), ("hidden_size", limits.HIDDEN_SIZE),
                            ("num_attention_heads", limits.ATTENTION_HEADS), ("seq_length", limits.SEQ_LENGTH),
                            ("vocab_size", limits.VOCAB_SIZE)):
            limit.positive_int(f"model.{name}", getattr(self, name))
        if self.ffn_hidden_size is not None:
            limits.FFN_HIDDEN_SIZE.positive_int("model.ffn_hidden_size", self.ffn_hidden_size)
        if self.num_query_groups is not None:
            v.positive_int("model.num_query_groups", self.num_query_groups)
            v.divides("model.num_query_groups", self.num_query_groups,
                      "model.num_attention_heads", self.num_attention_heads)
        if self.tied_embeddings is not None:
            v.boolean("model.tied_embeddings", self.tied_embeddings)
        v.string("model.name", self.name)
        v.divides("model.num_attention_heads", self.num_attention_heads,
                  "model.hidden_size", self.hidden_size)
        if self.family is Family.LLAMA and self.head_dim % 2:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) / model.num_attention_heads "
                              f"({self.num_attention_heads}) = {self.head_dim}: rotary position embeddings "
                              "rotate pairs of channels, so a Llama head dimension must be even")

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
