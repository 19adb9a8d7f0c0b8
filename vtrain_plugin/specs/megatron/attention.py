"""The attention variants a Megatron-LM command line asks for, as ModelSpec fields.

Multi-latent attention (``--multi-latent-attention`` with ``--q-lora-rank``, ``--kv-lora-rank``,
``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``), sliding windows (``--window-size``,
``--window-attn-skip-freq``), attention sinks (``--softmax-type learnable``) and NoPE layers
(``--no-rope-freq``), with one answer on every input path (:mod:`vtrain_plugin.specs.attention`
checks the fields).

MLA's other flags change the values of YaRN's rotary frequencies only (``--rotary-scaling-factor``,
``--mscale``, ``--mscale-all-dim``), not time or memory: accepted. ``--qk-layernorm`` with MLA is
the RMSNorm of its compressed query and key/value, which vtrain traces with MLA (DeepSeek-V3 and
Kimi K2 set it); MLA without it is refused. ``--enable-gpt-oss`` is Megatron-LM's switch for GPT-OSS's
layer; vtrain reads the model from the flags a script states, so it is accepted only beside the
attention flags it stands for (``--softmax-type learnable``, ``--window-size``), stated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.flag_values import positive_int
from vtrain_plugin.specs.megatron.moe_flags import layer_freq
from vtrain_plugin.specs.model_features import not_modelled

MLA_FLAGS = {"--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank", "--qk-head-dim": "qk_head_dim",
             "--qk-pos-emb-head-dim": "qk_pos_emb_head_dim", "--v-head-dim": "v_head_dim"}
GPT_OSS_STATED = ("--softmax-type", "--window-size")


def consumed_by_attention(given: Mapping[str, Any]) -> frozenset[str]:
    """Flags this module reads that the argument table would otherwise refuse: ``--qk-layernorm``
    under MLA (its latent norms)."""
    return frozenset({"--qk-layernorm"}) if given.get("--multi-latent-attention") else frozenset()


def attention_fields(given: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """The ModelSpec fields of the attention flags in ``given``; MLA dims given without MLA (which
    Megatron-LM ignores) are noted in ``notes``."""
    out: dict[str, Any] = {}
    if given.get("--multi-latent-attention"):
        if not given.get("--qk-layernorm"):
            raise not_modelled("--multi-latent-attention without --qk-layernorm",
                               "multi-latent attention without the norms of its compressed query and key/value")
        out["multi_latent_attention"] = True
        out.update({name: positive_int(flag, given[flag]) for flag, name in MLA_FLAGS.items() if flag in given})
    else:
        ignored = [flag for flag in MLA_FLAGS if flag in given]
        if ignored:
            notes.append(f"{', '.join(ignored)} without --multi-latent-attention (Megatron-LM ignores them)")
    if "--window-size" in given:
        out["window_size"] = _window(given["--window-size"])
    if "--window-attn-skip-freq" in given and "--window-size" not in given:
        notes.append("--window-attn-skip-freq without --window-size (Megatron-LM then has no window)")
    elif "--window-attn-skip-freq" in given:
        text = given["--window-attn-skip-freq"]
        try:
            out["window_attn_skip_freq"] = int(text)
        except ValueError:
            raise not_modelled(f"--window-attn-skip-freq {text}", "a per-layer pattern of window layers") from None
    softmax = given.get("--softmax-type", "vanilla")
    if softmax not in ("vanilla", "off-by-one", "learnable"):
        raise ConfigError(f"--softmax-type must be vanilla, off-by-one or learnable, got {softmax!r}")
    if softmax == "off-by-one":
        raise not_modelled("--softmax-type off-by-one", "an off-by-one softmax")
    if softmax != "vanilla":
        out["softmax_type"] = softmax
    if "--no-rope-freq" in given:
        out["no_rope_freq"] = layer_freq("--no-rope-freq", given["--no-rope-freq"])
    if given.get("--enable-gpt-oss"):
        missing = [flag for flag in GPT_OSS_STATED if flag not in given]
        if missing:
            raise ConfigError(f"--enable-gpt-oss without {' and '.join(missing)}: vtrain reads GPT-OSS's attention "
                              f"from the flags it stands for; state them (GPT-OSS: --softmax-type learnable "
                              f"--window-size 127,0 --window-attn-skip-freq 2)")
    return out




def _window(text: Any) -> tuple[int, int]:
    """Megatron-LM's ``--window-size`` (``back,ahead``; -1 is no limit): two integers."""
    parts = str(text).strip("()[] ").split(",")
    try:
        back, ahead = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--window-size must be two integers 'back,ahead' (e.g. 127,0), got {text!r}") from None
    return back, ahead
