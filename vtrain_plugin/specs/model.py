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
from vtrain_plugin.specs.attention import check_attention_fields, mla_parameters, sink_parameters


DEFAULT_MOE_ROUTER_TOPK = 2  # megatron-core's moe_router_topk


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
    # Mixture of experts (megatron-core MoELayer in every layer); None: a dense MLP. See moe_* below.
    num_experts: int | None = None
    moe_router_topk: int | None = None  # experts per token; default 2 (Megatron's)
    moe_ffn_hidden_size: int | None = None  # of one expert; default ffn_size
    # The busiest expert receives this many times the balanced share of the routed tokens (1: every
    # expert gets tokens * topk / experts); the others share the rest evenly
    # (megatron_adapters/moe_routing.py).
    moe_routing_skew: float = 1.0
    moe_shared_expert_intermediate_size: int | None = None  # shared experts: refused, not modelled
    # Attention variants (vtrain_plugin/specs/attention.py): megatron-core's multi-latent attention
    # (MLA: the ranks and head dims below, None: Megatron-LM's defaults), sliding windows (tokens back,
    # tokens ahead; full attention on every window_attn_skip_freq-th layer) and attention sinks
    # (softmax_type "learnable": one learned logit per head). Off by default.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected without compression
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | None = None
    softmax_type: str = "vanilla"
    # Multi-token prediction (megatron-core's MTP block on the last pipeline stage): this many MTP
    # layers, each a transformer layer of the model's kind after its embedding and hidden norms and
    # projection, sharing the embedding and output layer. None: off.
    mtp_num_layers: int | None = None

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
        if self.family is Family.LLAMA and self.head_dim % 2 and not self.multi_latent_attention:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) / model.num_attention_heads "
                              f"({self.num_attention_heads}) = {self.head_dim}: rotary position embeddings "
                              "rotate pairs of channels, so a Llama head dimension must be even")
        check_moe_fields(self)
        check_attention_fields(self)
        if self.mtp_num_layers is not None:
            v.positive_int("model.mtp_num_layers", self.mtp_num_layers)

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.family is Family.LLAMA:
            raw = int(2 * 4 * self.hidden_size / 3)
            return 256 * ((raw + 255) // 256)
        return 4 * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def router_topk(self) -> int:
        """Experts per token (0 for a dense model)."""
        if not self.is_moe:
            return 0
        return self.moe_router_topk if self.moe_router_topk is not None else DEFAULT_MOE_ROUTER_TOPK

    @property
    def expert_ffn_size(self) -> int:
        """FFN hidden size of one expert (0 for a dense model)."""
        if not self.is_moe:
            return 0
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

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
        h = self.hidden_size
        kv = 2 * self.query_groups * self.head_dim
        gpt = self.family is Family.GPT
        if gpt:
            attn = h * (h + kv) + (h + kv) + h * h + h
            norms = 2 * 2 * h
            positions = self.seq_length * h
            final_norm = 2 * h
        else:
            attn = h * (h + kv) + h * h
            norms = 2 * h
            positions = 0
            final_norm = h
        if self.multi_latent_attention:
            attn = mla_parameters(self)
        attn += sink_parameters(self)
        mlp = self._mlp_parameters(self.ffn_size)
        if self.is_moe:  # the router's gate (with a bias in a GPT layer), then every expert's MLP
            mlp = self.num_experts * (h + (1 if gpt else 0)) + self.num_experts * self._mlp_parameters(self.expert_ffn_size)
        embed = self.vocab_size * h * (1 if self.tied else 2)
        # an MTP layer: its embedding and hidden norms, the projection of both (2h -> h), a layer, its final norm
        mtp = (self.mtp_num_layers or 0) * (3 * final_norm + 2 * h * h + attn + mlp + norms)
        return self.num_layers * (attn + mlp + norms) + embed + positions + final_norm + mtp

    def _mlp_parameters(self, f: int) -> int:
        h = self.hidden_size
        if self.family is Family.GPT:
            return h * f + f + f * h + h
        return h * 2 * f + f * h

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["family"] = self.family.value
        d["dtype"] = self.dtype.value
        return d


def check_moe_fields(model: ModelSpec) -> None:
    """The MoE fields of ``model``: all left unset for a dense model; for a MoE model, at most
    ``num_experts`` experts per token and a skew the token count allows (the busiest expert gets at
    most every token once: ``skew * tokens * topk / experts <= tokens``)."""
    moe_fields = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
    if model.num_experts is None:
        for name in moe_fields:
            if getattr(model, name) is not None:
                raise ConfigError(f"model.{name} needs model.num_experts (a mixture-of-experts model)")
        if model.moe_routing_skew != 1.0:
            raise ConfigError("model.moe_routing_skew needs model.num_experts (a mixture-of-experts model)")
        return
    v.positive_int("model.num_experts", model.num_experts)
    for name in moe_fields:
        if getattr(model, name) is not None:
            v.positive_int(f"model.{name}", getattr(model, name))
    topk, experts = model.router_topk, model.num_experts
    if topk > experts:
        raise ConfigError(f"model.moe_router_topk ({topk}) must not exceed model.num_experts ({experts})")
    skew = v.positive_number("model.moe_routing_skew", model.moe_routing_skew)
    if not 1.0 <= skew <= experts / topk:
        raise ConfigError(f"model.moe_routing_skew ({skew:g}) must lie in [1, num_experts / moe_router_topk = "
                          f"{experts} / {topk} = {experts / topk:g}]: the busiest expert gets at most every token")
    if model.moe_shared_expert_intermediate_size is not None:
        raise ConfigError("model.moe_shared_expert_intermediate_size: shared experts are not modelled yet "
                          "(leave it unset to trace the routed experts only)")
