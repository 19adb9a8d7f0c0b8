"""Map a megatron-core ``TransformerConfig`` onto vtrain's ModelSpec and ParallelPlan.

Fields are read by attribute, so no megatron type leaks out. Every field that changes the traced
graph is either honoured (dims, GQA, dtype, the GPT or Llama layer, TP, CP and its communication, PP,
virtual pipeline, SP, recompute, uneven pipeline splits, MoE experts, top-k and expert FFN, expert
parallel and expert TP sizes, the token dispatcher) or refused with a one-line :class:`ConfigError`
naming it (shared experts, token dropping, grouped-GEMM experts, fp8 / fp4, multi-token prediction,
custom pipeline layouts, sliding-window attention, ...: the features of
:mod:`vtrain_plugin.specs.model_features`, refused alike on every input path): a config is never
traced as something it is not, except for the normalization, linear biases and dropout of the
layer, which are noted in a warning when they differ from the family's. Two MoE settings are
vtrain's own: the router's load-balancing loss is the auxiliary loss of Megatron-LM's MoE recipes
(:data:`megatron_adapters.moe.LOAD_BALANCING`), and routing follows the balanced assumption.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.model_features import QKV_BIAS, REFUSED, layer_note, not_modelled, unmodelled_warning
from vtrain_plugin.specs.parallel import CpCommType, ParallelPlan, Recompute, TokenDispatcher


log = logging.getLogger(__name__)


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


def _is_one(value: Any) -> bool:
    return value in (None, 1)


UNMODELLED = (
    Unmodelled("moe_shared_expert_intermediate_size", _is_none, "shared experts"),
    Unmodelled("moe_expert_capacity_factor", _is_none, "MoE token dropping (capacity factor)"),
    Unmodelled("moe_grouped_gemm", _is_false, "grouped-GEMM experts (vtrain traces megatron's SequentialMLP)"),
    Unmodelled("moe_latent_size", _is_none, "MoE latent projections"),
    Unmodelled("moe_layer_freq", _is_one, "dense layers between MoE layers"),
    Unmodelled("moe_permute_fusion", _is_false, "fused MoE permutation"),
    Unmodelled("moe_token_dispatcher_type", lambda value: value in (None, "alltoall", "allgather"),
               "the flex token dispatcher (DeepEP / HybridEP)"),
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
    if getattr(config, "add_qkv_bias", False) and not getattr(config, "add_bias_linear", True):
        raise not_modelled("TransformerConfig.add_qkv_bias=True with add_bias_linear=False", QKV_BIAS)


def model_spec_from_transformer_config(config: Any, *, vocab_size: int, seq_length: int) -> ModelSpec:
    """The ModelSpec of a megatron-core TransformerConfig built with the local layer spec."""
    refuse_unmodelled(config)
    family = _family(config)
    heads = config.num_attention_heads
    kv_channels = getattr(config, "kv_channels", None)
    mla = bool(getattr(config, "multi_latent_attention", False))  # MLA has its own head dims
    if kv_channels is not None and kv_channels * heads != config.hidden_size and not mla:
        raise ConfigError(f"TransformerConfig.kv_channels({kv_channels}) * num_attention_heads({heads}) != "
                          f"hidden_size({config.hidden_size}): vtrain models head_dim = hidden / heads")
    return ModelSpec(
        family=family,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        seq_length=seq_length,
        vocab_size=vocab_size,
        num_experts=getattr(config, "num_moe_experts", None),
        moe_router_topk=getattr(config, "moe_router_topk", None) if getattr(config, "num_moe_experts", None) else None,
        moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None),
        dtype=Dtype.BF16 if getattr(config, "bf16", False) else Dtype.FP16 if getattr(config, "fp16", False) else Dtype.FP32,
        **attention_fields_of_config(config),
    )


def consumed_attention_fields(config: Any) -> frozenset[str]:
    """Fields :func:`attention_fields_of_config` reads that :data:`UNMODELLED` would refuse:
    ``qk_layernorm`` under MLA (the norms of its compressed query and key/value)."""
    return frozenset({"qk_layernorm"}) if getattr(config, "multi_latent_attention", False) else frozenset()


def attention_fields_of_config(config: Any) -> dict[str, Any]:
    """The ModelSpec fields of the config's attention variants (:mod:`vtrain_plugin.specs.attention`):
    multi-latent attention (an ``MLATransformerConfig``: its ranks and head dims; its rotary type and
    YaRN factors change values only), a sliding window and its skip frequency, the softmax type."""
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
    if getattr(config, "mtp_num_layers", None):  # multi-token prediction (not an attention variant; read here too)
        out["mtp_num_layers"] = config.mtp_num_layers
    return out


def _family(config: Any) -> Family:
    """GPT (GeLU MLP) or Llama (SwiGLU MLP), as a Megatron-LM command line picks it: the MLP shapes
    the GEMMs; another activation is refused. A normalization, linear biases or dropout other than
    the family's are noted in one warning, as on the other input paths
    (:mod:`vtrain_plugin.specs.model_features`)."""
    normalization = getattr(config, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"TransformerConfig.normalization={normalization!r}: must be 'LayerNorm' or 'RMSNorm'")
    gated = bool(getattr(config, "gated_linear_unit", False))
    family = Family.LLAMA if gated else Family.GPT
    activation = getattr(getattr(config, "activation_func", None), "__name__", "")
    if activation != ("silu" if gated else "gelu"):
        raise ConfigError(f"TransformerConfig.activation_func is {activation!r} with gated_linear_unit={gated}: "
                          f"vtrain traces a GeLU MLP (gpt) or a SwiGLU one (llama, gated_linear_unit=True and silu)")
    biases = bool(getattr(config, "add_bias_linear", True))
    notes = [layer_note(f"TransformerConfig.normalization={normalization!r}", family, "normalization", normalization),
             layer_note(f"TransformerConfig.add_bias_linear={biases}", family, "biases", "on" if biases else "off")]
    for field in ("hidden_dropout", "attention_dropout"):
        value = getattr(config, field, 0.1)
        notes.append(layer_note(f"TransformerConfig.{field}={value}", family, "dropout", value))
    notes = [note for note in notes if note]
    if notes:
        log.warning("warning: %s", unmodelled_warning("TransformerConfig fields", notes))
    return family


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
    if plan is None:
        return ParallelPlan(**{name: value for name, (_, value) in stated.items()})
    defaults = ParallelPlan()
    for name, (field, value) in stated.items():
        ours = getattr(plan, name)
        if value != getattr(defaults, name) and value != ours:
            raise ConfigError(f"parallel.{name} ({_show(ours)}) != TransformerConfig.{field} ({_show(value)}): "
                              f"pass a plan that agrees with the config, or parallel=None to use the config's")
    return plan


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
    granularity = getattr(config, "recompute_granularity", None)
    if granularity is None:
        return Recompute.NONE
    if granularity == "selective":
        modules = list(getattr(config, "recompute_modules", None) or ["core_attn"])
        if modules != ["core_attn"]:
            raise ConfigError(f"TransformerConfig.recompute_modules={modules!r}: selective recompute of "
                              f"modules other than ['core_attn'] is not modelled yet")
        return Recompute.SELECTIVE
    if granularity == "full":
        method, layers = getattr(config, "recompute_method", None), getattr(config, "recompute_num_layers", None)
        if (method, layers) != ("uniform", 1):
            raise ConfigError(f"TransformerConfig.recompute_method={method!r}, recompute_num_layers={layers!r}: "
                              f"vtrain models full recompute of every layer (method 'uniform', 1 layer per group)")
        return Recompute.FULL
    raise ConfigError(f"TransformerConfig.recompute_granularity={granularity!r}: must be None, 'selective' or 'full'")


def _cp_comm_type(config: Any) -> CpCommType:
    """TransformerEngine's K/V exchange: None means Megatron-LM's default, p2p; a per-layer list must
    name one type (vtrain's layers are alike); TE's a2a and a2a+p2p are not modelled."""
    value = getattr(config, "cp_comm_type", None)
    kinds = set(value) if isinstance(value, (list, tuple)) else {value}
    if len(kinds) != 1:
        raise ConfigError(f"TransformerConfig.cp_comm_type={value!r}: one type for every layer is modelled")
    (kind,) = kinds
    if kind is None:
        return CpCommType.P2P
    if kind not in {c.value for c in CpCommType}:
        raise ConfigError(f"TransformerConfig.cp_comm_type={kind!r}: must be one of "
                          f"{', '.join(c.value for c in CpCommType)} (a2a and a2a+p2p are not modelled yet)")
    return CpCommType(kind)


def _show(value: Any) -> str:
    if isinstance(value, (Recompute, CpCommType, TokenDispatcher)):
        return value.value
    return repr(value) if isinstance(value, bool) else str(value)
