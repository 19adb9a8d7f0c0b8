"""The attention variants of a ModelSpec: multi-latent attention, sliding windows, attention sinks, NoPE layers.

Checks their fields, and derives what they imply: MLA's ranks and head dims (Megatron-LM's defaults
where unset) and parameter count, which layers have a window or no rotary embedding, the sink parameters.

megatron-core builds each variant itself (``MLASelfAttention``; ``DotProductAttention`` with a
window or a learnable softmax offset) and vtrain traces what it builds
(:mod:`megatron_adapters.gpt`); this module holds only the arithmetic the specs need before any trace:
the parameter count of :attr:`ModelSpec.num_parameters`, and which of a stage's layers have a
window (megatron-core's ``is_layer_window_attention``) or skip the rotary embedding (NoPE,
megatron-core's ``no_rope_freq``), since windowed and full layers, NoPE and RoPE layers, are traced
once each and counted per stage (:mod:`vtrain_plugin.capture.tracer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError

if TYPE_CHECKING:
    from vtrain_plugin.specs.model import ModelSpec

# Megatron-LM's argument defaults for MLA (megatron/training/arguments.py, --kv-lora-rank ...).
MLA_DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
MLA_FIELDS = ("q_lora_rank", *MLA_DEFAULTS)
SOFTMAX_TYPES = ("vanilla", "learnable")  # "off-by-one": a fixed zero logit, not modelled yet
# ModelSpec fields of this module (and multi-token prediction's): a chunk trace's key leaves them out
# while at these values, so a model without them keeps the key it had before they existed.
OFF = {"multi_latent_attention": False, **dict.fromkeys(MLA_FIELDS), "window_size": None,
       "window_attn_skip_freq": None, "softmax_type": "vanilla", "mtp_num_layers": None, "no_rope_freq": None}


def check_attention_fields(model: ModelSpec) -> None:
    """Validate (and normalise) the attention-variant fields of ``model``."""
    v.boolean("model.multi_latent_attention", model.multi_latent_attention)
    if not model.multi_latent_attention:
        for name in MLA_FIELDS:
            if getattr(model, name) is not None:
                raise ConfigError(f"model.{name} needs model.multi_latent_attention (MLA)")
    else:
        for name in MLA_FIELDS:
            if getattr(model, name) is not None:
                v.positive_int(f"model.{name}", getattr(model, name))
        if model.family.value != "llama":
            raise ConfigError("model.multi_latent_attention needs model.family llama (MLA's layers: RMSNorm, no "
                              "linear biases, rotary positions inside the attention)")
        if model.num_query_groups not in (None, model.num_attention_heads):
            raise ConfigError(f"model.num_query_groups ({model.num_query_groups}) with multi-latent attention: MLA "
                              f"has one key and value per head (leave num_query_groups unset)")
        if mla_dim(model, "qk_pos_emb_head_dim") % 2:
            raise ConfigError(f"model.qk_pos_emb_head_dim ({mla_dim(model, 'qk_pos_emb_head_dim')}) must be even: "
                              f"rotary position embeddings rotate pairs of channels")
    if model.window_size is not None:
        window = model.window_size
        if isinstance(window, str):
            window = window.split(",")
        if not isinstance(window, (list, tuple)) or len(window) != 2:
            raise ConfigError(f"model.window_size must be two integers (tokens back, tokens ahead), got {window!r}")
        back, ahead = (_window_edge(f"model.window_size[{i}]", w) for i, w in enumerate(window))
        if ahead != 0:
            raise ConfigError(f"model.window_size[1] ({ahead}) must be 0: a causal decoder attends to no later "
                              f"token (windows that look ahead are not modelled)")
        if back < 0:
            raise ConfigError(f"model.window_size[0] ({back}) must be at least 0 (-1: no window, leave it unset)")
        object.__setattr__(model, "window_size", (back, ahead))
    if model.window_attn_skip_freq is not None:
        if model.window_size is None:
            raise ConfigError("model.window_attn_skip_freq needs model.window_size (sliding-window attention)")
        v.positive_int("model.window_attn_skip_freq", model.window_attn_skip_freq)
    if model.softmax_type is None:  # off, as a plan file may say
        object.__setattr__(model, "softmax_type", "vanilla")
    if model.softmax_type == "off-by-one":
        raise ConfigError("model.softmax_type='off-by-one': an off-by-one softmax is not modelled by vtrain yet")
    v.one_of("model.softmax_type", model.softmax_type, SOFTMAX_TYPES)
    _check_nope(model)


def _check_nope(model: ModelSpec) -> None:
    """``no_rope_freq`` checked as megatron-core checks it (an integer must divide the layers, a list
    has one 0 / 1 per layer) and stored in one spelling: a list that repeats ``[0]*(N-1)+[1]`` as
    the integer N, one without a NoPE layer as None."""
    freq = model.no_rope_freq
    if freq is None:
        return
    n = model.num_layers
    if isinstance(freq, (list, tuple)):
        if len(freq) != n or any(isinstance(x, bool) or x not in (0, 1) for x in freq):
            raise ConfigError(f"model.no_rope_freq: a per-layer pattern needs model.num_layers ({n}) entries, each 0 "
                              f"(RoPE) or 1 (NoPE); got {len(freq)}")
        freq = _as_frequency(tuple(int(x) for x in freq))
    elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"model.no_rope_freq must be a positive integer or a list of 0 / 1 per layer, got {freq!r}")
    elif n % freq:
        raise ConfigError(f"model.no_rope_freq ({freq}) must divide model.num_layers ({n}) (megatron-core's rule)")
    object.__setattr__(model, "no_rope_freq", freq)
    if freq is None:
        return
    if model.layer.position_embedding_type.value != "rope":
        raise ConfigError("model.no_rope_freq needs model.position_embedding_type rope (NoPE layers skip the rotary "
                          "embedding)")
    if model.multi_latent_attention:
        raise ConfigError("model.no_rope_freq with multi-latent attention: megatron-core's MLA applies its rotary "
                          "embedding on every layer (only SelfAttention reads no_rope_freq)")
    if model.mtp_num_layers is not None:
        raise ConfigError("model.no_rope_freq with model.mtp_num_layers: megatron-core 0.16 looks an MTP layer's "
                          "number up in no_rope_freq, past its num_layers entries")
    if model.hybrid_layer_pattern is not None:
        raise ConfigError("model.no_rope_freq with model.hybrid_layer_pattern: NoPE layers in a Mamba hybrid are not "
                          "modelled by vtrain yet")
    if mixes_nope(model) and (mixes_windows(model) or model.has_dense_layers_between_moe):
        other = "windowed and full-attention layers" if mixes_windows(model) else "dense and MoE layers"
        raise ConfigError(f"model.no_rope_freq: NoPE and RoPE layers mixed with {other} are not modelled by "
                          f"vtrain yet")


def _as_frequency(pattern: tuple[int, ...]) -> int | tuple[int, ...] | None:
    if not any(pattern):
        return None
    for freq in range(1, len(pattern) + 1):
        if len(pattern) % freq == 0 and pattern == ((0,) * (freq - 1) + (1,)) * (len(pattern) // freq):
            return freq
    return pattern


def _window_edge(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool) or int(value) != float(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def mla_dim(model: ModelSpec, name: str) -> int:
    """An MLA rank or head dim of ``model`` (``name`` in :data:`MLA_DEFAULTS`), Megatron-LM's default when unset."""
    value = getattr(model, name)
    return MLA_DEFAULTS[name] if value is None else value


def mla_parameters(model: ModelSpec) -> int:
    """Parameters of one MLA self-attention, as ``MLASelfAttention`` builds it (without biases): the
    query down projection, its norm and up projection (or one query projection without
    ``q_lora_rank``), the key/value down projection (with the shared rotary key), its norm and up
    projection, the output projection."""
    h, n = model.hidden_size, model.num_attention_heads
    qk, rope, v_dim, kv = (mla_dim(model, name) for name in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                                             "kv_lora_rank"))
    q = h * n * (qk + rope) if model.q_lora_rank is None else \
        h * model.q_lora_rank + model.q_lora_rank + model.q_lora_rank * n * (qk + rope)
    return q + h * (kv + rope) + kv + kv * n * (qk + v_dim) + n * v_dim * h


def sink_parameters(model: ModelSpec) -> int:
    """The learnable softmax offsets of one layer: one per attention head."""
    return model.num_attention_heads if model.softmax_type == "learnable" else 0


def mixes_windows(model: ModelSpec) -> bool:
    """Whether ``model`` alternates windowed and full-attention layers (a window with a skip
    frequency above 1)."""
    return model.window_size is not None and (model.window_attn_skip_freq or 1) > 1


def is_windowed_layer(model: ModelSpec, layer_number: int) -> bool:
    """megatron-core's ``is_layer_window_attention`` for ``layer_number`` (1-based, over the whole model)."""
    if model.window_size is None:
        return False
    if model.window_attn_skip_freq is None:
        return True
    return layer_number % model.window_attn_skip_freq != 0


def windowed_layers(model: ModelSpec, first_layer: int, count: int) -> int:
    """How many of the ``count`` layers from ``first_layer`` (1-based) have a window."""
    return sum(is_windowed_layer(model, n) for n in range(first_layer, first_layer + count))


def nope_pattern(model: ModelSpec) -> tuple[bool, ...]:
    """Whether each layer skips the rotary embedding (megatron-core's ``no_rope_freq``, 0-based by
    layer number - 1: an integer N makes layers N, 2N, ... NoPE)."""
    freq, n = model.no_rope_freq, model.num_layers
    if freq is None:
        return (False,) * n
    if isinstance(freq, int):
        return tuple(i % freq == freq - 1 for i in range(n))
    return tuple(bool(x) for x in freq)


def mixes_nope(model: ModelSpec) -> bool:
    """Whether ``model`` has both NoPE and RoPE layers."""
    pattern = nope_pattern(model)
    return any(pattern) and not all(pattern)


def nope_layers(model: ModelSpec, first_layer: int, count: int) -> int:
    """How many of the ``count`` layers from ``first_layer`` (1-based) skip the rotary embedding."""
    return sum(nope_pattern(model)[first_layer - 1:first_layer - 1 + count])


def off(model_dict: dict[str, Any]) -> dict[str, Any]:
    """``model_dict`` without the fields of this module that are at their off value."""
    return {k: val for k, val in model_dict.items() if not (k in OFF and val == OFF[k])}
