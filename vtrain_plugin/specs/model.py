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


DEFAULT_MOE_ROUTER_TOPK = 2  # megatron-core's moe_router_topk


class RouterScore(StrEnum):
    """The MoE router's score function over the gating logits (megatron-core's moe_router_score_function)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class TokenDropPolicy(StrEnum):
    """Which tokens an expert over capacity drops (megatron-core's moe_token_drop_policy)."""

    PROBS = "probs"  # the lowest routing probabilities
    POSITION = "position"  # the last in the sequence


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
    # MoE layer features megatron-core's MoELayer builds (checked in check_moe_fields; all at their
    # megatron-core defaults for a model without them).
    moe_shared_expert_intermediate_size: int | None = None  # FFN of the shared experts (SharedExpertMLP)
    moe_shared_expert_overlap: bool = False  # shared expert computes beside the token all-to-all
    # 1: every layer MoE; k: layers 0, k, 2k, ... MoE and the rest dense; a tuple: 1 (MoE) or 0
    # (dense) per layer, as Megatron-LM's --moe-layer-freq "([0]*3+[1]*58)".
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_grouped_gemm: bool = False  # experts as one grouped GEMM per linear (TE's TEGroupedMLP)
    moe_router_score_function: RouterScore = RouterScore.SOFTMAX
    moe_router_num_groups: int | None = None  # group-limited routing: experts in this many groups
    moe_router_group_topk: int | None = None  # ... of which a token picks its experts from this many
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias on the scores
    moe_router_topk_scaling_factor: float | None = None  # the top-k probabilities scaled by this
    moe_expert_capacity_factor: float | None = None  # an expert takes at most this x the balanced share
    moe_pad_expert_input_to_capacity: bool = False  # ... and is padded up to it
    moe_token_drop_policy: TokenDropPolicy = TokenDropPolicy.PROBS

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", Family(v.one_of("model.family", self.family, [f.value for f in Family])))
        object.__setattr__(self, "dtype", Dtype(v.one_of("model.dtype", self.dtype, [d.value for d in MODEL_DTYPES])))
        object.__setattr__(self, "moe_router_score_function", RouterScore(v.one_of(
            "model.moe_router_score_function", self.moe_router_score_function, [r.value for r in RouterScore])))
        object.__setattr__(self, "moe_token_drop_policy", TokenDropPolicy(v.one_of(
            "model.moe_token_drop_policy", self.moe_token_drop_policy, [p.value for p in TokenDropPolicy])))
        if isinstance(self.moe_layer_freq, list):  # a plan file's list
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
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
        check_moe_fields(self)

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
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Whether each layer is a MoE layer (megatron-core's rule for moe_layer_freq k: layers
        0, k, 2k, ...); every layer is dense in a dense model."""
        if not self.is_moe:
            return (False,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return tuple(bool(x) for x in freq)
        return tuple(i % freq == 0 for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @property
    def has_dense_layers_between_moe(self) -> bool:
        """A MoE model with some dense layers (moe_layer_freq other than 1)."""
        return self.is_moe and not all(self.moe_layer_pattern)

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
        dense_mlp = self._mlp_parameters(self.ffn_size)
        moe_mlp = dense_mlp
        if self.is_moe:  # the router's gate (with a bias in a GPT layer), then every expert's MLP
            moe_mlp = self.num_experts * (h + (1 if gpt else 0)) + self.num_experts * self._mlp_parameters(self.expert_ffn_size)
            if self.moe_router_enable_expert_bias:
                moe_mlp += self.num_experts
            if self.moe_shared_expert_intermediate_size is not None:
                moe_mlp += self._mlp_parameters(self.moe_shared_expert_intermediate_size)
        moe_layers = self.num_moe_layers
        embed = self.vocab_size * h * (1 if self.tied else 2)
        return (self.num_layers * (attn + norms) + moe_layers * moe_mlp + (self.num_layers - moe_layers) * dense_mlp
                + embed + positions + final_norm)

    def _mlp_parameters(self, f: int) -> int:
        h = self.hidden_size
        if self.family is Family.GPT:
            return h * f + f + f * h + h
        return h * 2 * f + f * h

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["family"] = self.family.value
        d["dtype"] = self.dtype.value
        d["moe_router_score_function"] = self.moe_router_score_function.value
        d["moe_token_drop_policy"] = self.moe_token_drop_policy.value
        if isinstance(self.moe_layer_freq, tuple):
            d["moe_layer_freq"] = list(self.moe_layer_freq)
        return d


# The MoE fields that only a MoE model may set away from these values (megatron-core's defaults).
MOE_FEATURE_DEFAULTS = {
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_overlap": False, "moe_layer_freq": 1,
    "moe_grouped_gemm": False, "moe_router_score_function": RouterScore.SOFTMAX, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None,
    "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": TokenDropPolicy.PROBS,
}


def check_moe_fields(model: ModelSpec) -> None:
    """The MoE fields of ``model``: all left unset for a dense model; for a MoE model, at most
    ``num_experts`` experts per token and a skew the token count allows (the busiest expert gets at
    most every token once: ``skew * tokens * topk / experts <= tokens``), and the rules megatron-core
    puts on its MoE features (group-limited routing, capacity, the layer pattern)."""
    moe_fields = ("moe_router_topk", "moe_ffn_hidden_size")
    if model.num_experts is None:
        for name in moe_fields:
            if getattr(model, name) is not None:
                raise ConfigError(f"model.{name} needs model.num_experts (a mixture-of-experts model)")
        if model.moe_routing_skew != 1.0:
            raise ConfigError("model.moe_routing_skew needs model.num_experts (a mixture-of-experts model)")
        for name, default in MOE_FEATURE_DEFAULTS.items():
            if getattr(model, name) != default:
                raise ConfigError(f"model.{name} needs model.num_experts (a mixture-of-experts model)")
        return
    v.positive_int("model.num_experts", model.num_experts)
    for name in (*moe_fields, "moe_shared_expert_intermediate_size"):
        if getattr(model, name) is not None:
            v.positive_int(f"model.{name}", getattr(model, name))
    topk, experts = model.router_topk, model.num_experts
    if topk > experts:
        raise ConfigError(f"model.moe_router_topk ({topk}) must not exceed model.num_experts ({experts})")
    skew = v.positive_number("model.moe_routing_skew", model.moe_routing_skew)
    if not 1.0 <= skew <= experts / topk:
        raise ConfigError(f"model.moe_routing_skew ({skew:g}) must lie in [1, num_experts / moe_router_topk = "
                          f"{experts} / {topk} = {experts / topk:g}]: the busiest expert gets at most every token")
    for name in ("moe_shared_expert_overlap", "moe_grouped_gemm", "moe_router_enable_expert_bias",
                 "moe_pad_expert_input_to_capacity"):
        v.boolean(f"model.{name}", getattr(model, name))
    if model.moe_shared_expert_overlap and model.moe_shared_expert_intermediate_size is None:
        raise ConfigError("model.moe_shared_expert_overlap needs model.moe_shared_expert_intermediate_size "
                          "(a shared expert to overlap)")
    if model.moe_router_enable_expert_bias and model.moe_router_score_function is not RouterScore.SIGMOID:
        raise ConfigError("model.moe_router_enable_expert_bias needs model.moe_router_score_function sigmoid "
                          "(megatron-core's aux-loss-free routing)")
    _check_layer_freq(model)
    _check_group_routing(model)
    if model.moe_router_topk_scaling_factor is not None:
        v.positive_finite_number("model.moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor)
    if model.moe_expert_capacity_factor is not None:
        v.positive_finite_number("model.moe_expert_capacity_factor", model.moe_expert_capacity_factor)
    elif model.moe_pad_expert_input_to_capacity:
        raise ConfigError("model.moe_pad_expert_input_to_capacity needs model.moe_expert_capacity_factor "
                          "(the capacity to pad to)")
    if model.moe_expert_capacity_factor is not None and skew != 1.0:
        raise ConfigError("model.moe_routing_skew with model.moe_expert_capacity_factor: vtrain assumes "
                          "balanced routing under a capacity (leave the skew at 1)")


def _check_layer_freq(model: ModelSpec) -> None:
    freq = model.moe_layer_freq
    if isinstance(freq, tuple):
        if len(freq) != model.num_layers or any(x not in (0, 1) or isinstance(x, bool) for x in freq):
            raise ConfigError(f"model.moe_layer_freq: a per-layer pattern needs model.num_layers "
                              f"({model.num_layers}) entries, each 0 (dense) or 1 (MoE); got {len(freq)}")
        if not any(freq):
            raise ConfigError("model.moe_layer_freq: the pattern has no MoE layer (leave num_experts unset "
                              "for a dense model)")
        return
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"model.moe_layer_freq must be a positive integer or a list of 0 / 1 per layer, "
                          f"got {freq!r}")


def _check_group_routing(model: ModelSpec) -> None:
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ConfigError("model.moe_router_num_groups and model.moe_router_group_topk go together "
                          "(group-limited routing)")
    v.positive_int("model.moe_router_num_groups", groups)
    v.positive_int("model.moe_router_group_topk", group_topk)
    v.divides("model.moe_router_num_groups", groups, "model.num_experts", model.num_experts)
    if group_topk > groups:
        raise ConfigError(f"model.moe_router_group_topk ({group_topk}) must not exceed "
                          f"model.moe_router_num_groups ({groups})")
    per_group = model.num_experts // groups
    if model.router_topk > group_topk * per_group:
        raise ConfigError(f"model.moe_router_topk ({model.router_topk}) must not exceed moe_router_group_topk "
                          f"({group_topk}) x experts per group ({per_group}) = {group_topk * per_group}")
