"""Mamba hybrids (megatron-core ``MambaModel``): the layer pattern, its checks and its pipeline split.

A hybrid is described by one letter per layer (megatron-core's ``hybrid_override_pattern``,
Megatron-LM's ``--hybrid-layer-pattern``): ``M`` a Mamba-2 layer, ``*`` a self-attention layer,
``-`` an MLP layer, ``E`` a MoE layer (megatron-core's MoE transformer layer, the model's
``num_experts``). The pattern is the model's depth; a pipeline rank holds the contiguous slice of
it megatron-core's ``MambaStack`` selects, so each stage is costed from one traced layer of each
kind, counted per stage (:func:`stage_patterns`). megatron-core's own defaults fill the Mamba
dimensions a spec leaves unset (:data:`DEFAULT_STATE_DIM` and the rest).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from vtrain_plugin.core.errors import ConfigError

if TYPE_CHECKING:
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
LAYER_KINDS = (MAMBA, ATTENTION, MLP, MOE)  # megatron-core 0.16's Symbols.VALID
# megatron-core 0.16 TransformerConfig defaults, and MambaMixer's expand (d_inner = 2 * hidden)
DEFAULT_STATE_DIM, DEFAULT_HEAD_DIM, DEFAULT_NUM_GROUPS, EXPAND = 128, 64, 8, 2
CHUNK_SIZE = 128  # MambaMixer's chunk_size (no config field sets it)
D_CONV = 4  # MambaMixer's d_conv


def check_pattern(field: str, pattern: str) -> str:
    """``pattern`` if every letter is a modelled layer kind, else a one-line ConfigError."""
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{field} must be a non-empty string of layer letters (M, *, -, E), got {pattern!r}")
    unknown = sorted(set(pattern) - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(f"{field}: {unknown[0]!r} is not a layer letter (M Mamba, * attention, - MLP, E MoE), "
                          f"in {pattern!r}")
    return pattern


def allocate_pattern(num_layers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """The pattern megatron-core's ``allocate_layers`` builds from target ratios (no override):
    attention evenly spaced between Mamba sections, then MLP layers right-justified among the Mamba
    ones (``ssm/mamba_hybrid_layer_allocation._allocate_auto``, 0.16)."""
    if not (0.0 <= attention_ratio <= 1.0 and 0.0 <= mlp_ratio <= 1.0 and attention_ratio + mlp_ratio <= 1.0):
        raise ConfigError(f"--hybrid-attention-ratio ({attention_ratio:g}) and --hybrid-mlp-ratio ({mlp_ratio:g}) "
                          f"must each lie in [0, 1] and sum to at most 1")
    kinds = [MAMBA] * num_layers
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    section = mamba / (attention + 1)
    x = section
    for i in range(num_layers):
        if x < 0.5:
            kinds[i] = ATTENTION
            x += section
        else:
            x -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        mamba -= mlp
        ratio = mamba / mlp
        x = ratio
        for i in range(num_layers):
            if kinds[i] == MAMBA:
                if x < 0.5:
                    kinds[i] = MLP
                    x += ratio
                else:
                    x -= 1
    return "".join(kinds)


def traced_kinds(pattern: str) -> str:
    """The layers a hybrid chunk is traced with: one of each kind in ``pattern``, in the order they
    first appear (every stage of a role is traced alike; each stage counts its own)."""
    return "".join(dict.fromkeys(pattern))


def stage_patterns(plan: ParallelPlan, model: ModelSpec) -> tuple[str, ...]:
    """Each pipeline rank's slice of the pattern, as ``MambaStack`` selects it: contiguous, of the
    sizes the pipeline split gives (even, or uneven first / last stage)."""
    from vtrain_plugin.specs.pipeline_split import stage_layers

    pattern = model.hybrid_layer_pattern
    assert pattern is not None
    out, start = [], 0
    for (n,) in stage_layers(plan, model):
        out.append(pattern[start:start + n])
        start += n
    return tuple(out)


def layer_counts(pattern: str) -> dict[str, int]:
    """Layers of each kind in ``pattern`` (every modelled kind, 0 when absent)."""
    counts = Counter(pattern)
    return {kind: counts.get(kind, 0) for kind in LAYER_KINDS}
