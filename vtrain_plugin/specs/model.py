"""What is trained: the model spec (a megatron-core GPTModel described by its dimensions).

A frozen dataclass validated on construction; derived values are properties. How it is laid out
(:mod:`vtrain_plugin.specs.parallel`), run (:mod:`vtrain_plugin.specs.training`) and on what
(:mod:`vtrain_plugin.specs.cluster`) stay separate inputs: application, execution and system.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.dtypes import MODEL_DTYPES, Dtype
from vtrain_plugin.specs import hybrid, limits
from vtrain_plugin.specs.attention import check_attention_fields, mla_parameters, sink_parameters
from vtrain_plugin.specs.model_features import POSITIONS_NOT_MODELLED, not_modelled


DEFAULT_MOE_ROUTER_TOPK = 2  # megatron-core's moe_router_topk


class RouterScore(StrEnum):
    """The MoE router's score function over the gating logits (megatron-core's moe_router_score_function)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class LoadBalancing(StrEnum):
    """The router's load balancing (megatron-core's moe_router_load_balancing_type) vtrain traces."""

    # An auxiliary loss over the micro-batch's tokens (coefficient 0.01); Megatron-LM's several losses
    # summed are traced as it.
    AUX_LOSS = "aux_loss"
    SEQ_AUX_LOSS = "seq_aux_loss"  # ... over each sequence's tokens (DeepSeek-V3's)
    GLOBAL_AUX_LOSS = "global_aux_loss"  # ... over the global batch's (per-expert counts summed over TP x DP x CP)
    SINKHORN = "sinkhorn"  # S-BASE: sinkhorn-normalised scores pick the experts; no auxiliary loss


# Iterations of megatron-core's sinkhorn per MoE layer and step, assumed: it iterates until the mean
# change of its expert scaling is under 1e-4, which is data. Measured with megatron-core's own loop on
# 8192 tokens of random logits: 2 to 12 iterations over logit standard deviations 0.1 to 4 and 8 to 128
# experts; 4 at a standard deviation of 2, above a router's at initialisation (0.02 x sqrt(hidden) ~ 1.3
# at hidden 4096).
SINKHORN_ITERATIONS = 4


class RouterDtype(StrEnum):
    """The dtype of the MoE router's gating and scores (megatron-core's moe_router_dtype)."""

    FP32 = "fp32"
    FP64 = "fp64"


class TokenDropPolicy(StrEnum):
    """Which tokens an expert over capacity drops (megatron-core's moe_token_drop_policy)."""

    PROBS = "probs"  # the lowest routing probabilities
    POSITION = "position"  # the last in the sequence


class Family(StrEnum):
    """A preset of the layer's choices (:data:`FAMILY_LAYERS`), each overridable by its own field."""

    GPT = "gpt"  # LayerNorm, GeLU MLP, learned absolute positions, multi-head attention
    LLAMA = "llama"  # RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention


class Normalization(StrEnum):  # TransformerConfig.normalization
    LAYER_NORM = "LayerNorm"
    RMS_NORM = "RMSNorm"


class Activation(StrEnum):  # TransformerConfig.activation_func, by its name
    GELU = "gelu"
    SILU = "silu"  # with gated_linear_unit: SwiGLU
    SQUARED_RELU = "squared_relu"  # megatron.core.activations.squared_relu
    QUICK_GELU = "quick_gelu"  # x * sigmoid(1.702 x); with gated_linear_unit: GPT-OSS's quick GeGLU


class PositionEmbedding(StrEnum):  # GPTModel's position_embedding_type
    LEARNED_ABSOLUTE = "learned_absolute"
    ROPE = "rope"
    NONE = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerChoices:
    """The choices of a transformer layer that a family presets (TransformerConfig's names)."""

    normalization: Normalization
    activation: Activation
    gated_linear_unit: bool
    add_bias_linear: bool
    hidden_dropout: float
    attention_dropout: float
    position_embedding_type: PositionEmbedding


FAMILY_LAYERS = {
    Family.GPT: LayerChoices(normalization=Normalization.LAYER_NORM, activation=Activation.GELU,
                             gated_linear_unit=False, add_bias_linear=True, hidden_dropout=0.1,
                             attention_dropout=0.1, position_embedding_type=PositionEmbedding.LEARNED_ABSOLUTE),
    Family.LLAMA: LayerChoices(normalization=Normalization.RMS_NORM, activation=Activation.SILU,
                               gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, position_embedding_type=PositionEmbedding.ROPE),
}
# The layer fields of ModelSpec and the value each has when it asks for nothing beyond the family:
# a model at these values is the family's, with the family's trace and cache key.
LAYER_FIELD_DEFAULTS = {"kv_channels": None, "normalization": None, "activation": None, "gated_linear_unit": None,
                        "add_bias_linear": None, "add_qkv_bias": False, "hidden_dropout": None,
                        "attention_dropout": None, "position_embedding_type": None, "rotary_percent": 1.0,
                        "qk_layernorm": False, "qk_l2_norm": False, "layernorm_zero_centered_gamma": False,
                        "glu_linear_offset": 0.0, "activation_func_clamp_value": None}


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
    moe_permute_fusion: bool = False  # token permutations as TE's fused moe_permute kernels
    moe_router_fusion: bool = False  # router top-k and aux loss as TE's fused router kernels
    moe_router_score_function: RouterScore = RouterScore.SOFTMAX
    moe_router_num_groups: int | None = None  # group-limited routing: experts in this many groups
    moe_router_group_topk: int | None = None  # ... of which a token picks its experts from this many
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias on the scores
    moe_router_topk_scaling_factor: float | None = None  # the top-k probabilities scaled by this
    moe_expert_capacity_factor: float | None = None  # an expert takes at most this x the balanced share
    moe_pad_expert_input_to_capacity: bool = False  # ... and is padded up to it
    moe_token_drop_policy: TokenDropPolicy = TokenDropPolicy.PROBS
    moe_router_load_balancing_type: LoadBalancing = LoadBalancing.AUX_LOSS
    moe_router_dtype: RouterDtype | None = None  # the gating GEMM, scores and top-k in this dtype; None: the model's
    moe_router_pre_softmax: bool = False  # softmax over every expert before the top-k (after it: over the k)
    # The layer's choices (megatron-core's names, :data:`LAYER_FIELD_DEFAULTS`); None: the family's
    # (:data:`FAMILY_LAYERS`, read through :attr:`layer`). A value equal to the family's is stored as
    # None, so a model has one spelling whatever the input path.
    kv_channels: int | None = None  # head dim; default hidden_size / num_attention_heads
    normalization: Normalization | None = None
    activation: Activation | None = None
    gated_linear_unit: bool | None = None
    add_bias_linear: bool | None = None
    add_qkv_bias: bool = False  # a QKV bias when the other linears have none
    hidden_dropout: float | None = None
    attention_dropout: float | None = None
    position_embedding_type: PositionEmbedding | None = None
    rotary_percent: float = 1.0  # of the head dim that RoPE rotates
    qk_layernorm: bool = False  # the layer's normalization on each head's query and key
    qk_l2_norm: bool = False  # Llama 4's L2 norm on each head's query and key
    # Changes neither time nor memory: TransformerEngine's norm kernels add the 1 to gamma inside.
    layernorm_zero_centered_gamma: bool = False
    # The gated unit's extras (GPT-OSS): act(x_glu) * (x_linear + glu_linear_offset), both halves
    # clamped to activation_func_clamp_value first (x_glu from above, x_linear both ways).
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    # Mamba hybrid (megatron-core MambaModel, vtrain_plugin/specs/hybrid.py): one letter per layer,
    # M Mamba-2, * attention, - MLP, E MoE (of num_experts experts); None: a transformer (GPTModel). The mamba_* fields default to
    # megatron-core's (state 128, head dim 64, 8 groups, heads 2 * hidden / head dim).
    hybrid_layer_pattern: str | None = None
    mamba_state_dim: int | None = None
    mamba_head_dim: int | None = None
    mamba_num_groups: int | None = None
    mamba_num_heads: int | None = None
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
    # NoPE layers (Llama 4), megatron-core's no_rope_freq: N, every N-th layer (layers N, 2N, ...) without
    # the rotary embedding; or 0 (RoPE) / 1 (NoPE) per layer. None: RoPE on every layer.
    no_rope_freq: int | tuple[int, ...] | None = None
    # Multi-token prediction (megatron-core's MTP block on the last pipeline stage): this many MTP
    # layers, each a transformer layer of the model's kind after its embedding and hidden norms and
    # projection, sharing the embedding and output layer. None: off.
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", Family(v.one_of("model.family", self.family, [f.value for f in Family])))
        object.__setattr__(self, "dtype", Dtype(v.one_of("model.dtype", self.dtype, [d.value for d in MODEL_DTYPES])))
        object.__setattr__(self, "moe_router_score_function", RouterScore(v.one_of(
            "model.moe_router_score_function", self.moe_router_score_function, [r.value for r in RouterScore])))
        object.__setattr__(self, "moe_token_drop_policy", TokenDropPolicy(v.one_of(
            "model.moe_token_drop_policy", self.moe_token_drop_policy, [p.value for p in TokenDropPolicy])))
        object.__setattr__(self, "moe_router_load_balancing_type", LoadBalancing(v.one_of(
            "model.moe_router_load_balancing_type", self.moe_router_load_balancing_type,
            [b.value for b in LoadBalancing])))
        if self.moe_router_dtype is not None:
            object.__setattr__(self, "moe_router_dtype", RouterDtype(v.one_of(
                "model.moe_router_dtype", self.moe_router_dtype, [d.value for d in RouterDtype])))
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
        check_layer_fields(self)
        check_moe_fields(self)
        check_hybrid_fields(self)
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
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Whether each layer is a MoE layer (megatron-core's rule for moe_layer_freq k: layers
        0, k, 2k, ...); every layer is dense in a dense model."""
        if not self.is_moe:
            return (False,) * self.num_layers
        if self.hybrid_layer_pattern is not None:
            return tuple(kind == hybrid.MOE for kind in self.hybrid_layer_pattern)
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return tuple(bool(x) for x in freq)
        return tuple(i % freq == 0 for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @property
    def has_dense_layers_between_moe(self) -> bool:
        """A transformer with MoE and dense layers (moe_layer_freq other than 1); a hybrid's layers are
        its pattern's."""
        return self.is_moe and not self.is_hybrid and not all(self.moe_layer_pattern)

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid_layer_pattern is not None

    @property
    def mamba_state(self) -> int:
        return self.mamba_state_dim or hybrid.DEFAULT_STATE_DIM

    @property
    def mamba_headdim(self) -> int:
        return self.mamba_head_dim or hybrid.DEFAULT_HEAD_DIM

    @property
    def mamba_groups(self) -> int:
        return self.mamba_num_groups or hybrid.DEFAULT_NUM_GROUPS

    @property
    def mamba_heads(self) -> int:
        """Mamba heads: mamba_num_heads, else megatron-core's d_inner / head dim (d_inner = 2 * hidden)."""
        return self.mamba_num_heads or hybrid.EXPAND * self.hidden_size // self.mamba_headdim

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_heads * self.mamba_headdim

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
        """``kv_channels``, by default ``hidden_size / num_attention_heads``."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def layer(self) -> LayerChoices:
        """The layer's choices: the family's, with this model's overrides."""
        preset = FAMILY_LAYERS[self.family]
        return replace(preset, **{f.name: getattr(self, f.name) for f in fields(LayerChoices)
                                  if getattr(self, f.name) is not None})

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates (0 without rotary positions): Megatron's
        ``int(kv_channels * rotary_percent)``."""
        if self.layer.position_embedding_type is not PositionEmbedding.ROPE:
            return 0
        return int(self.head_dim * self.rotary_percent)

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole (unsharded) model, embeddings included."""
        h, d, layer = self.hidden_size, self.head_dim, self.layer
        biases = layer.add_bias_linear
        q, kv = self.num_attention_heads * d, 2 * self.query_groups * d
        attn = h * (q + kv) + (q + kv) * (biases or self.add_qkv_bias) + q * h + h * biases
        norm = 2 if layer.normalization is Normalization.LAYER_NORM else 1  # weight (and bias) per channel
        qk_norms = 2 * norm * d if self.qk_layernorm and not self.qk_l2_norm else 0
        positions = self.seq_length * h if layer.position_embedding_type is PositionEmbedding.LEARNED_ABSOLUTE else 0
        dense_mlp = self._mlp_parameters(self.ffn_size)
        moe_mlp = dense_mlp
        if self.is_moe:  # the router's gate (with a bias when linears have one), then every expert's MLP
            moe_mlp = self.num_experts * (h + biases) + self.num_experts * self._mlp_parameters(self.expert_ffn_size)
            if self.moe_router_enable_expert_bias:
                moe_mlp += self.num_experts
            if self.moe_shared_expert_intermediate_size is not None:
                moe_mlp += self._mlp_parameters(self.moe_shared_expert_intermediate_size)
        if self.multi_latent_attention:  # MLA's own projections and latent norms
            attn, qk_norms = mla_parameters(self), 0
        attn += sink_parameters(self)
        moe_layers = self.num_moe_layers
        embed = self.vocab_size * h * (1 if self.tied else 2)
        # an MTP layer: its embedding and hidden norms, the projection of both (2h -> h), a layer of the
        # model's kind, its final norm
        mtp = (self.mtp_num_layers or 0) * (3 * norm * h + 2 * h * h + attn + qk_norms + 2 * norm * h
                                            + (moe_mlp if self.is_moe else dense_mlp))
        if self.is_hybrid:
            counts = hybrid.layer_counts(self.hybrid_layer_pattern or "")
            return (counts[hybrid.MAMBA] * (norm * h + self._mamba_mixer_parameters())
                    + counts[hybrid.ATTENTION] * (norm * h + attn + qk_norms)
                    + counts[hybrid.MLP] * (norm * h + dense_mlp)
                    + counts[hybrid.MOE] * (norm * h + moe_mlp)
                    + embed + positions + norm * h)
        return (self.num_layers * (attn + qk_norms + 2 * norm * h) + moe_layers * moe_mlp
                + (self.num_layers - moe_layers) * dense_mlp + embed + positions + norm * h + mtp)

    @property
    def num_expert_parameters(self) -> int:
        """Of :attr:`num_parameters`, the routed experts' weights (every MoE layer's, MTP layers'
        included): what expert parallelism splits, where TP splits the rest."""
        if not self.is_moe or self.is_hybrid:
            return 0
        layers = self.num_moe_layers + (self.mtp_num_layers or 0)
        return layers * self.num_experts * self._mlp_parameters(self.expert_ffn_size)

    def _mamba_mixer_parameters(self) -> int:
        """megatron-core's MambaMixer: in_proj (z, x, B, C, dt), depthwise conv1d with bias, dt_bias,
        A_log, D, the gated RMSNorm's weight, out_proj."""
        h, d, g, n, heads = self.hidden_size, self.mamba_d_inner, self.mamba_groups, self.mamba_state, self.mamba_heads
        conv = d + 2 * g * n
        return h * (2 * d + 2 * g * n + heads) + conv * (hybrid.D_CONV + 1) + 3 * heads + d + d * h

    def _mlp_parameters(self, f: int) -> int:
        h, layer = self.hidden_size, self.layer
        up = 2 * f if layer.gated_linear_unit else f
        return h * up + f * h + (up + h) * layer.add_bias_linear

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name, value in d.items():
            if isinstance(value, StrEnum):
                d[name] = value.value
        if isinstance(self.moe_layer_freq, tuple):
            d["moe_layer_freq"] = list(self.moe_layer_freq)
        return d


# The MoE fields that only a MoE model may set away from these values (megatron-core's defaults).
MOE_FEATURE_DEFAULTS = {
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_overlap": False, "moe_layer_freq": 1,
    "moe_grouped_gemm": False, "moe_permute_fusion": False, "moe_router_fusion": False,
    "moe_router_score_function": RouterScore.SOFTMAX, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None,
    "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": TokenDropPolicy.PROBS, "moe_router_load_balancing_type": LoadBalancing.AUX_LOSS,
    "moe_router_dtype": None, "moe_router_pre_softmax": False,
}


def check_layer_fields(model: ModelSpec) -> None:
    """The layer fields of ``model`` checked, and stored as None (their default) where they equal the
    family's; the head dim even where RoPE rotates it (it rotates pairs of channels)."""
    preset = FAMILY_LAYERS[model.family]
    enums = {"normalization": Normalization, "activation": Activation, "position_embedding_type": PositionEmbedding}
    if model.position_embedding_type in POSITIONS_NOT_MODELLED:
        raise not_modelled(f"model.position_embedding_type={model.position_embedding_type}",
                           POSITIONS_NOT_MODELLED[model.position_embedding_type])
    for name, enum in enums.items():
        value = getattr(model, name)
        if value is not None:
            object.__setattr__(model, name, enum(v.one_of(f"model.{name}", value, [e.value for e in enum])))
    for name in ("gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "qk_l2_norm",
                 "layernorm_zero_centered_gamma"):
        if getattr(model, name) is not None:
            v.boolean(f"model.{name}", getattr(model, name))
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(model, name)
        if value is not None:
            if not 0 <= v.non_negative_number(f"model.{name}", value) < 1:
                raise ConfigError(f"model.{name} ({value}) must be a probability below 1")
            object.__setattr__(model, name, float(value))
    _check_glu_extras(model)
    if model.kv_channels is not None:
        v.positive_int("model.kv_channels", model.kv_channels)
    else:
        v.divides("model.num_attention_heads", model.num_attention_heads, "model.hidden_size", model.hidden_size)
    percent = v.positive_number("model.rotary_percent", model.rotary_percent)
    if percent > 1:
        raise ConfigError(f"model.rotary_percent ({percent:g}) must lie in (0, 1]")
    object.__setattr__(model, "rotary_percent", float(percent))
    for f in fields(LayerChoices):
        if getattr(model, f.name) == getattr(preset, f.name):
            object.__setattr__(model, f.name, None)
    if model.kv_channels == model.hidden_size // model.num_attention_heads \
            and model.kv_channels * model.num_attention_heads == model.hidden_size:
        object.__setattr__(model, "kv_channels", None)
    if model.multi_latent_attention:  # MLA has head dims and latent norms of its own (specs/attention.py)
        object.__setattr__(model, "kv_channels", None)
        object.__setattr__(model, "qk_layernorm", False)
    layer = model.layer
    if layer.add_bias_linear:
        object.__setattr__(model, "add_qkv_bias", False)  # the QKV bias is there anyway
    if model.qk_l2_norm:
        object.__setattr__(model, "qk_layernorm", False)  # megatron-core's spec builds the L2 norm then
    if layer.position_embedding_type is not PositionEmbedding.ROPE:
        object.__setattr__(model, "rotary_percent", 1.0)  # Megatron ignores it without RoPE
    elif (model.rotary_dim % 2 or model.rotary_dim == 0) and not model.multi_latent_attention:  # MLA: its rope dim
        what = "the head dim (kv_channels)" if model.rotary_percent == 1 else \
            f"the rotated channels int(kv_channels x rotary_percent) = int({model.head_dim} x {model.rotary_percent:g})"
        raise ConfigError(f"model: {what} = {model.rotary_dim} must be even and positive: rotary position "
                          f"embeddings rotate pairs of channels")


def _check_glu_extras(model: ModelSpec) -> None:
    """glu_linear_offset and activation_func_clamp_value act on the gated unit's two halves only."""
    offset = model.glu_linear_offset
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ConfigError(f"model.glu_linear_offset must be a finite number, got {offset!r}")
    object.__setattr__(model, "glu_linear_offset", float(offset))
    clamp = model.activation_func_clamp_value
    if clamp is not None:
        object.__setattr__(model, "activation_func_clamp_value",
                           float(v.positive_finite_number("model.activation_func_clamp_value", clamp)))
    if (offset or clamp is not None) and not model.layer.gated_linear_unit:
        name = "glu_linear_offset" if offset else "activation_func_clamp_value"
        raise ConfigError(f"model.{name} needs model.gated_linear_unit (it acts on the gated unit's halves)")


def check_hybrid_fields(model: ModelSpec) -> None:
    """The hybrid fields of ``model``: the mamba_* fields need a pattern; the pattern has one
    modelled letter per layer; the Mamba heads split into head dim and groups."""
    mamba = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")
    if model.hybrid_layer_pattern is None:
        for name in mamba:
            if getattr(model, name) is not None:
                raise ConfigError(f"model.{name} needs model.hybrid_layer_pattern (a Mamba hybrid)")
        return
    pattern = hybrid.check_pattern("model.hybrid_layer_pattern", model.hybrid_layer_pattern)
    if len(pattern) != model.num_layers:
        raise ConfigError(f"model.hybrid_layer_pattern has {len(pattern)} layers, model.num_layers is "
                          f"{model.num_layers}: one letter per layer")
    if model.is_moe != (hybrid.MOE in pattern):
        raise ConfigError("model.num_experts and a MoE layer (E) in model.hybrid_layer_pattern go together: "
                          "the pattern places a hybrid's MoE layers, num_experts sizes them")
    if model.moe_layer_freq != 1:
        raise ConfigError("model.moe_layer_freq with model.hybrid_layer_pattern: a hybrid's MoE layers are its "
                          "pattern's E layers")
    for name in mamba:
        if getattr(model, name) is not None:
            v.positive_int(f"model.{name}", getattr(model, name))
    if model.mamba_num_heads is None and (hybrid.EXPAND * model.hidden_size) % model.mamba_headdim:
        raise ConfigError(f"model.mamba_head_dim ({model.mamba_headdim}) must divide the Mamba inner width "
                          f"2 x model.hidden_size ({hybrid.EXPAND * model.hidden_size})")
    if model.mamba_heads % model.mamba_groups:
        raise ConfigError(f"model.mamba_num_groups ({model.mamba_groups}) must divide the Mamba heads "
                          f"({model.mamba_heads})")


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
    for name in ("moe_shared_expert_overlap", "moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion",
                 "moe_router_enable_expert_bias",
                 "moe_pad_expert_input_to_capacity", "moe_router_pre_softmax"):
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
