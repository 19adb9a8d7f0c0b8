"""The Mamba hybrid a Megatron-LM command line describes (``pretrain_mamba.py``), as ModelSpec fields.

The layer pattern is ``--hybrid-layer-pattern`` (Megatron-LM's newer spelling) or
``--hybrid-override-pattern``, else the one megatron-core allocates from ``--hybrid-attention-ratio``
and ``--hybrid-mlp-ratio`` (all Mamba when neither is given); the pattern gives the depth, so
``--num-layers`` may be left out and must match when given. ``--mamba-*`` set the mixer's sizes
(unset: megatron-core's defaults, which are Megatron-LM's). Why here and not in the flag table:
these flags decide together which model is built, and pretrain_gpt.py ignores them, so a GPT command
line that gives them is refused rather than estimated as something it does not train.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.hybrid import allocate_pattern, check_pattern
from vtrain_plugin.specs.megatron.flag_values import positive_int
from vtrain_plugin.specs.megatron.model import Given

PATTERN_FLAGS = ("--hybrid-layer-pattern", "--hybrid-override-pattern")
RATIO_FLAGS = ("--hybrid-attention-ratio", "--hybrid-mlp-ratio")
DIM_FLAGS = {"--mamba-state-dim": "mamba_state_dim", "--mamba-head-dim": "mamba_head_dim",
             "--mamba-num-groups": "mamba_num_groups", "--mamba-num-heads": "mamba_num_heads"}
HYBRID_FLAGS = (*PATTERN_FLAGS, *RATIO_FLAGS, *DIM_FLAGS, "--is-hybrid-model", "--disable-mamba-mem-eff-path")
MAMBA_SCRIPT = "pretrain_mamba"


def hybrid_fields(script: str, given: Given, fields: dict[str, Any]) -> dict[str, Any]:
    """The hybrid's ModelSpec fields (with ``num_layers`` when ``fields`` lacks it); none for a GPT
    command line. ``script`` is the .py file the launcher runs ("" when unknown)."""
    name = PurePosixPath(script).name
    flags = [flag for flag in HYBRID_FLAGS if flag in given]
    if not name.startswith(MAMBA_SCRIPT) and not (flags and not name):
        if flags:
            raise ConfigError(f"{flags[0]} with {name}: a Mamba hybrid is trained by pretrain_mamba.py "
                              f"(pretrain_gpt.py builds a GPT and ignores it)")
        return {}
    if given.get("--disable-mamba-mem-eff-path"):
        raise ConfigError("--disable-mamba-mem-eff-path: the unfused Mamba path (causal_conv1d and "
                          "mamba_chunk_scan_combined apart) is not modelled by vtrain yet")
    patterns = {flag: given[flag] for flag in PATTERN_FLAGS if flag in given}
    if len(patterns) > 1:
        raise ConfigError("give --hybrid-layer-pattern or --hybrid-override-pattern, not both")
    out: dict[str, Any] = {}
    ratios = [_ratio(flag, given.get(flag, 0.0)) for flag in RATIO_FLAGS]
    if patterns:
        ((flag, pattern),) = patterns.items()
        pattern = check_pattern(flag, pattern)
        layers = fields.get("num_layers")
        if layers is not None and layers != len(pattern):
            raise ConfigError(f"{flag} has {len(pattern)} layers, --num-layers is {layers}: one letter per layer")
        if any(ratios) and sorted(allocate_pattern(len(pattern), *ratios)) != sorted(pattern):
            raise ConfigError(f"{flag} must have as many layers of each kind as --hybrid-attention-ratio and "
                              f"--hybrid-mlp-ratio allocate (megatron-core checks it)")
    elif "num_layers" in fields:
        pattern = allocate_pattern(fields["num_layers"], *ratios)
    else:
        raise ConfigError("--num-layers or --hybrid-layer-pattern is required")
    out["hybrid_layer_pattern"] = pattern
    out["num_layers"] = len(pattern)
    for flag, field in DIM_FLAGS.items():
        if flag in given:
            out[field] = positive_int(flag, given[flag])
    return out


def _ratio(flag: str, text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a number, got {text!r}") from None
