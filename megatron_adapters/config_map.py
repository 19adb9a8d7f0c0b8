"""Map a megatron-core ``TransformerConfig`` onto vtrain's ModelSpec and ParallelPlan.

Fields are read by attribute, so no megatron type leaks out. Every field that changes the traced
graph is either honoured (dims, GQA, head dim, dtype, the layer's normalization, activation, gated
MLP, linear and QKV biases, dropout and QK norms, TP, CP and its communication, PP, virtual
pipeline, SP, recompute, uneven pipeline splits, MoE experts, top-k and expert FFN, expert parallel
and expert TP sizes, the token dispatcher (flex: its backend and SMs), the EP all-to-all overlap and
delayed weight gradients, TE's fused MoE permutation and router (costed, not traced), the MoE features of
:data:`vtrain_plugin.specs.model.MOE_FEATURE_DEFAULTS`: shared experts, dense layers between MoE
layers, grouped-GEMM experts, router variants (their dtype, pre-softmax, load-balancing loss), token dropping) or refused with a one-line
:class:`ConfigError` naming it (fp8 / fp4, multi-token prediction, MoE latent projections, custom
pipeline layouts, sliding-window attention, ...: the features of
:mod:`vtrain_plugin.specs.model_features`, refused alike on every input path): a config is never
traced as something it is not. The position embedding is a GPTModel argument, not a config field:
a bare config gets its family's (rotary with a gated MLP, else learned), a built GPTModel its own
(:mod:`megatron_adapters.gpt_model`). Two MoE settings are
vtrain's own: several load-balancing losses summed are traced as the auxiliary loss of Megatron-LM's
MoE recipes (:data:`megatron_adapters.moe.LOAD_BALANCING`), and routing follows the balanced assumption.
The config's training settings (the jit fusions it turns off, per-token loss) are
:func:`training_fields_of_transformer_config`'s, read as Megatron-LM's flags set them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.model import MOE_FEATURE_DEFAULTS, Activation, Family, LoadBalancing, ModelSpec
from vtrain_plugin.specs.model_features import REFUSED, not_modelled
from vtrain_plugin.specs.parallel import (
    DEFAULT_RECOMPUTE_MODULES, FLEX_DEFAULT_NUM_SMS, RECOMPUTE_MODULES, CpCommType, FlexBackend, ParallelPlan, Recompute,
    TokenDispatcher)


@dataclass(frozen=True, slots=True)
class Unmodelled:
    """A TransformerConfig field vtrain cannot trace yet: refused unless ``is_default(value)``."""

    field: str
    is_default: Callable[[Any], bool]
    what: str


def _is_none(value: Any) -> bool:
    return value is None


def _is_false(value: Any) -> bool:
    return not value


UNMODELLED = (
    Unmodelled("moe_latent_size", _is_none, "MoE latent projections"),
    Unmodelled("fp8", _is_none, "fp8 training"),
    Unmodelled("fp4", _is_none, "fp4 training"),
    Unmodelled("tp_comm_overlap", _is_false, "TP communication overlap"),
    Unmodelled("cpu_offloading", _is_false, "activation offloading to the CPU"),
    Unmodelled("fine_grained_activation_offloading", _is_false, "activation offloading to the CPU"),
    Unmodelled("heterogeneous_block_specs", _is_false, "heterogeneous layers"),
    *(Unmodelled(feature.config_field, _is_false, feature.what) for feature in REFUSED),
)


def is_transformer_config(value: Any) -> bool:
    """Whether ``value`` is a megatron-core TransformerConfig (or a subclass); megatron-core is not
    imported to answer: a process that built one has it loaded."""
    module = sys.modules.get("megatron.core.transformer.transformer_config")
    return module is not None and isinstance(value, module.TransformerConfig)


def refuse_unmodelled(config: Any) -> None:
    """A ConfigError for the first field of ``config`` that vtrain cannot trace yet."""
    for rule in UNMODELLED:
        if rule.field in consumed_attention_fields(config):
            continue
        value = getattr(config, rule.field, None)
        if not rule.is_default(value):
            raise not_modelled(f"TransformerConfig.{rule.field}={value!r}", rule.what)


def model_spec_from_transformer_config(config: Any, *, vocab_size: int, seq_length: int,
                                       hybrid_layer_pattern: str | None = None) -> ModelSpec:
    """The ModelSpec of a megatron-core TransformerConfig built with the local layer spec; with
    ``hybrid_layer_pattern``, of a MambaModel built with that config and pattern."""
    refuse_unmodelled(config)
    gated = bool(getattr(config, "gated_linear_unit", False))
    hybrid = _hybrid_fields(config, hybrid_layer_pattern)
    return ModelSpec(
        family=Family.LLAMA if gated else Family.GPT,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        seq_length=seq_length,
        vocab_size=vocab_size,
        num_experts=getattr(config, "num_moe_experts", None),
        moe_router_topk=getattr(config, "moe_router_topk", None) if getattr(config, "num_moe_experts", None) else None,
        moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None),
        **_moe_features(config),
        dtype=Dtype.BF16 if getattr(config, "bf16", False) else Dtype.FP16 if getattr(config, "fp16", False) else Dtype.FP32,
        **layer_fields(config),
        **hybrid,
        **attention_fields_of_config(config),
    )


def consumed_attention_fields(config: Any) -> frozenset[str]:
    """Fields :func:`attention_fields_of_config` reads that :data:`UNMODELLED` would refuse:
    ``qk_layernorm`` under MLA (the norms of its compressed query and key/value)."""
    return frozenset({"qk_layernorm"}) if getattr(config, "multi_latent_attention", False) else frozenset()


def attention_fields_of_config(config: Any) -> dict[str, Any]:
    """The ModelSpec fields of the config's attention variants (:mod:`vtrain_plugin.specs.attention`):
    multi-latent attention (an ``MLATransformerConfig``: its ranks and head dims; its rotary type and
    YaRN factors change values only), a sliding window and its skip frequency, the softmax type, the
    NoPE layers (``no_rope_freq``, a per-layer list once the config is built)."""
    out: dict[str, Any] = {}
    if getattr(config, "multi_latent_attention", False):
        if not getattr(config, "qk_layernorm", False):
            raise not_modelled("TransformerConfig.multi_latent_attention=True with qk_layernorm=False",
                               "multi-latent attention without the norms of its compressed query and key/value")
        out["multi_latent_attention"] = True
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            out[name] = getattr(config, name)
    window = getattr(config, "window_size", None)
    if window is not None:
        out["window_size"] = tuple(window)
        skip = getattr(config, "window_attn_skip_freq", None)
        if skip is not None and not isinstance(skip, int):
            raise not_modelled(f"TransformerConfig.window_attn_skip_freq={skip!r}", "a per-layer pattern of window layers")
        out["window_attn_skip_freq"] = skip
    softmax = getattr(config, "softmax_type", "vanilla")
    if softmax == "off-by-one":
        raise not_modelled("TransformerConfig.softmax_type='off-by-one'", "an off-by-one softmax")
    if softmax != "vanilla":
        out["softmax_type"] = softmax
    no_rope = getattr(config, "no_rope_freq", None)
    if no_rope:
        out["no_rope_freq"] = tuple(no_rope) if isinstance(no_rope, list) else no_rope
    if getattr(config, "mtp_num_layers", None):  # multi-token prediction (not an attention variant; read here too)
        out["mtp_num_layers"] = config.mtp_num_layers
    return out


def _hybrid_fields(config: Any, pattern: str | None) -> dict[str, Any]:
    """A Mamba hybrid's ModelSpec fields: the pattern, which a TransformerConfig does not hold (the
    MambaModel takes it), and the config's Mamba dims."""
    if pattern is None:
        if getattr(config, "is_hybrid_model", False):
            raise ConfigError("TransformerConfig.is_hybrid_model=True: the layer pattern is MambaModel's, not the "
                              "config's; trace the built MambaModel, or a ModelSpec with hybrid_layer_pattern")
        return {}
    return {"hybrid_layer_pattern": pattern, "mamba_state_dim": config.mamba_state_dim,
            "mamba_head_dim": config.mamba_head_dim, "mamba_num_groups": config.mamba_num_groups,
            "mamba_num_heads": config.mamba_num_heads}


# The MoE features a TransformerConfig names as ModelSpec names them (the same field names), each
# read only from a MoE config and only when set away from megatron-core's default.
MOE_FEATURES = tuple(MOE_FEATURE_DEFAULTS)


def _moe_features(config: Any) -> dict[str, Any]:
    """The MoE feature fields of ``config`` (shared experts and their overlap, the MoE layer pattern,
    grouped-GEMM experts, the router's variants and sinkhorn load balancing, the capacity factor):
    ModelSpec checks them."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    out: dict[str, Any] = {}
    for name in MOE_FEATURES:
        value = getattr(config, name, MOE_FEATURE_DEFAULTS[name])
        if name == "moe_router_load_balancing_type" and (isinstance(value, list)
                                                          or value not in {b.value for b in LoadBalancing}):
            continue  # several losses summed (a list): vtrain traces the auxiliary loss (LOAD_BALANCING)
        if isinstance(value, list):
            value = tuple(value)
        if value != MOE_FEATURE_DEFAULTS[name]:
            out[name] = value
    return out


def layer_fields(config: Any) -> dict[str, Any]:
    """The layer's ModelSpec fields of ``config`` (megatron-core's names); an activation other than
    GeLU, SiLU (SwiGLU when gated), squared ReLU or quick GeLU is refused."""
    normalization = getattr(config, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"TransformerConfig.normalization={normalization!r}: must be 'LayerNorm' or 'RMSNorm'")
    activation = getattr(getattr(config, "activation_func", None), "__name__", "")
    if activation not in {a.value for a in Activation}:
        raise not_modelled(f"TransformerConfig.activation_func={activation or '?'}",
                           "an MLP activation other than gelu, silu (SwiGLU), squared_relu or quick_gelu")
    return dict(
        kv_channels=getattr(config, "kv_channels", None),
        normalization=normalization,
        activation=activation,
        gated_linear_unit=bool(getattr(config, "gated_linear_unit", False)),
        add_bias_linear=bool(getattr(config, "add_bias_linear", True)),
        add_qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
        hidden_dropout=float(getattr(config, "hidden_dropout", 0.1)),
        attention_dropout=float(getattr(config, "attention_dropout", 0.1)),
        qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
        qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)),
        layernorm_zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
        glu_linear_offset=float(getattr(config, "glu_linear_offset", 0.0) or 0.0),
        activation_func_clamp_value=getattr(config, "activation_func_clamp_value", None),
    )


# TransformerConfig's switch of each jit fusion (training.unfused_kernels names, UNFUSABLE).
FUSION_FIELDS = {"bias_activation": "bias_activation_fusion", "bias_dropout": "bias_dropout_fusion",
                 "rope": "apply_rope_fusion", "masked_softmax": "masked_softmax_fusion"}


def training_fields_of_transformer_config(config: Any, *, local_spec: bool = False) -> dict[str, Any]:
    """The TrainingSpec fields ``config`` holds (megatron-core's defaults: every fusion off), as
    Megatron-LM's flags set them (:mod:`vtrain_plugin.specs.megatron.fusion_flags`): ``unfused_kernels``,
    the fusions it turns off, and ``per_token_loss``. The bias-activation fusion counts as on for a GeLU
    MLP without a bias (nothing to fuse; Megatron-LM turns it off there) and with
    ``use_te_activation_func`` in TransformerEngine's layer spec (its activation op runs whatever the
    fusion); ``local_spec``: the config builds megatron-core's local layer spec, which has no TE op."""
    off = {name for name, field in FUSION_FIELDS.items() if not getattr(config, field, False)}
    swiglu = bool(getattr(config, "gated_linear_unit", False)) and \
        getattr(getattr(config, "activation_func", None), "__name__", "") == "silu"
    if getattr(config, "use_te_activation_func", False):
        off = off - {"bias_activation"} | ({"bias_activation"} if local_spec else set())
    elif not (swiglu or getattr(config, "add_bias_linear", True)):
        off.discard("bias_activation")
    return {"unfused_kernels": tuple(sorted(off)),
            "per_token_loss": bool(getattr(config, "calculate_per_token_loss", False))}


def parallel_plan_from_transformer_config(config: Any, plan: ParallelPlan | None) -> ParallelPlan:
    """``plan`` checked against the config's parallel fields, or the config's own plan when ``plan``
    is None. A field the config sets away from its default must agree with ``plan``."""
    stated = {
        "tensor_parallel": ("tensor_model_parallel_size", config.tensor_model_parallel_size or 1),
        "pipeline_parallel": ("pipeline_model_parallel_size", config.pipeline_model_parallel_size or 1),
        "virtual_pipeline": ("virtual_pipeline_model_parallel_size", config.virtual_pipeline_model_parallel_size
                             or getattr(config.pipeline_model_parallel_layout, "virtual_pipeline_model_parallel_size",
                                        None) or 1),
        "sequence_parallel": ("sequence_parallel", bool(config.sequence_parallel)),
        "recompute": ("recompute_granularity", _recompute(config)),
        "recompute_modules": ("recompute_modules", _recompute_modules(config)),
        "decoder_first_pipeline_num_layers": ("num_layers_in_first_pipeline_stage",
                                              getattr(config, "num_layers_in_first_pipeline_stage", None)),
        "decoder_last_pipeline_num_layers": ("num_layers_in_last_pipeline_stage",
                                             getattr(config, "num_layers_in_last_pipeline_stage", None)),
        "account_for_embedding_in_pipeline_split": (
            "account_for_embedding_in_pipeline_split", bool(getattr(config, "account_for_embedding_in_pipeline_split", False))),
        "account_for_loss_in_pipeline_split": (
            "account_for_loss_in_pipeline_split", bool(getattr(config, "account_for_loss_in_pipeline_split", False))),
        "context_parallel": ("context_parallel_size", getattr(config, "context_parallel_size", None) or 1),
        "pipeline_layout": ("pipeline_model_parallel_layout", _layout(config)),
        "cp_comm_type": ("cp_comm_type", _cp_comm_type(config)),
        "hierarchical_context_parallel_sizes": (
            "hierarchical_context_parallel_sizes",
            tuple(getattr(config, "hierarchical_context_parallel_sizes", None) or ()) or None),
        "expert_parallel": ("expert_model_parallel_size", getattr(config, "expert_model_parallel_size", None) or 1),
    }
    if getattr(config, "num_moe_experts", None):
        # megatron-core fills expert_tensor_parallel_size with the TP size when unset: that is the
        # plan's default (None), not a choice to check the plan against.
        etp = getattr(config, "expert_tensor_parallel_size", None)
        stated["expert_tensor_parallel"] = ("expert_tensor_parallel_size",
                                            None if etp == stated["tensor_parallel"][1] else etp)
        stated["moe_token_dispatcher"] = ("moe_token_dispatcher_type",
                                          TokenDispatcher(config.moe_token_dispatcher_type))
        stated.update(_moe_comm_fields(config))
    if plan is None:
        return ParallelPlan(**{name: value for name, (_, value) in stated.items()})
    defaults = ParallelPlan()
    for name, (field, value) in stated.items():
        ours = getattr(plan, name)
        if value != getattr(defaults, name) and value != ours:
            raise ConfigError(f"parallel.{name} ({_show(ours)}) != TransformerConfig.{field} ({_show(value)}): "
                              f"pass a plan that agrees with the config, or parallel=None to use the config's")
    return plan


def _moe_comm_fields(config: Any) -> dict[str, tuple[str, Any]]:
    """The flex dispatcher's backend and the SMs of that backend (megatron-core's default: None), the
    EP all-to-all overlap and the delayed weight gradients, as (config field, plan value)."""
    backend = FlexBackend(getattr(config, "moe_flex_dispatcher_backend", "deepep") or "deepep")
    sms_field = f"moe_{backend.value}_num_sms"
    sms = getattr(config, sms_field, None)
    return {"moe_flex_dispatcher_backend": ("moe_flex_dispatcher_backend", backend),
            "moe_flex_num_sms": (sms_field, None if sms in (None, FLEX_DEFAULT_NUM_SMS[backend]) else sms),
            "overlap_moe_expert_parallel_comm": ("overlap_moe_expert_parallel_comm",
                                                 bool(getattr(config, "overlap_moe_expert_parallel_comm", False))),
            "delay_wgrad_compute": ("delay_wgrad_compute", bool(getattr(config, "delay_wgrad_compute", False)))}


def _layout(config: Any) -> str | None:
    """The config's pipeline layout as a layout string (megatron-core holds it as a
    ``PipelineParallelLayerLayout``: its ``layout`` is ``[pp_rank][vp_rank]`` lists of layer types)."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is None or isinstance(layout, str):
        return layout
    symbols = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    rows = layout.layout
    stages = ["".join(symbols.get(getattr(t, "name", str(t)), "?") for t in rows[rank][chunk])
              for chunk in range(len(rows[0])) for rank in range(len(rows))]
    return "|".join(stages)


def _recompute(config: Any) -> Recompute:
    """The recompute mode (megatron-core has already made ``moe_layer_recompute`` selective
    recompute of ``moe``); the selective modules are :func:`_recompute_modules`'s."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity is None:
        return Recompute.NONE
    if granularity == "selective":
        return Recompute.SELECTIVE
    if granularity == "full":
        method, layers = getattr(config, "recompute_method", None), getattr(config, "recompute_num_layers", None)
        if (method, layers) != ("uniform", 1):
            raise ConfigError(f"TransformerConfig.recompute_method={method!r}, recompute_num_layers={layers!r}: "
                              f"vtrain models full recompute of every layer (method 'uniform', 1 layer per group)")
        return Recompute.FULL
    raise ConfigError(f"TransformerConfig.recompute_granularity={granularity!r}: must be None, 'selective' or 'full'")


def _recompute_modules(config: Any) -> tuple[str, ...] | None:
    """The modules selective recompute checkpoints (ParallelPlan checks the names), None without
    selective recompute (megatron-core reads them only with it) or at its default."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return None
    listed = list(getattr(config, "recompute_modules", None) or DEFAULT_RECOMPUTE_MODULES)
    unknown = [m for m in listed if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(f"TransformerConfig.recompute_modules={listed!r}: {unknown[0]!r} is not modelled by "
                          f"vtrain yet (it models {', '.join(RECOMPUTE_MODULES)})")
    modules = tuple(m for m in RECOMPUTE_MODULES if m in listed)  # ParallelPlan's order
    return None if modules == DEFAULT_RECOMPUTE_MODULES else modules


def _cp_comm_type(config: Any) -> CpCommType:
    """TransformerEngine's K/V exchange: None means Megatron-LM's default, p2p; a per-layer list must
    name one type (vtrain's layers are alike)."""
    value = getattr(config, "cp_comm_type", None)
    kinds = set(value) if isinstance(value, (list, tuple)) else {value}
    if len(kinds) != 1:
        raise ConfigError(f"TransformerConfig.cp_comm_type={value!r}: one type for every layer is modelled")
    (kind,) = kinds
    if kind is None:
        return CpCommType.P2P
    if kind not in {c.value for c in CpCommType}:
        raise ConfigError(f"TransformerConfig.cp_comm_type={kind!r}: must be one of "
                          f"{', '.join(c.value for c in CpCommType)}")
    return CpCommType(kind)


def _show(value: Any) -> str:
    if isinstance(value, (Recompute, CpCommType, TokenDispatcher, FlexBackend)):
        return value.value
    return repr(value) if isinstance(value, bool) else str(value)
