"""The model FLOPs of a Mamba hybrid as Megatron-LM counts them (``num_floating_point_operations``,
its hybrid branch), behind a hybrid's TFLOP/s and MFU.

Per forward of ``T`` tokens in sequences of ``s``: attention layers ``4 T h (h + h g / n) + 2 T s h``
(projections, and the causal score and context products), MLP layers ``4 T h f`` (x 3/2 gated),
Mamba layers ``2 T h (2 d + 2 G N + H) + 7 T d N + 2 T d h`` with Megatron's ``d = 2 h`` (in_proj,
the scan, out_proj), the logits ``2 T h V`` over the padded vocabulary; forward and backward are
3x the forward. Why Megatron's count and not the traced kernels': MFU is then the quantity Megatron
logs, and the scan's FLOPs (its note says the count is rough) move it by little.
"""

from __future__ import annotations

from vtrain_plugin.specs import hybrid
from vtrain_plugin.specs.model import Family, ModelSpec


def hybrid_forward_flops(model: ModelSpec, *, sequences: int, tensor_parallel: int = 1) -> int:
    """FLOPs of one forward of ``sequences`` sequences through the whole hybrid (Megatron-LM's
    formula, its padded vocabulary: 128 x ``tensor_parallel``)."""
    assert model.hybrid_layer_pattern is not None
    counts = hybrid.layer_counts(model.hybrid_layer_pattern)
    s, h = model.seq_length, model.hidden_size
    tokens = sequences * s
    n, g = model.num_attention_heads, model.query_groups
    attention = 4 * tokens * h * (h + h * g // n) + 2 * tokens * s * h
    gated = model.family is Family.LLAMA
    mlp = 4 * tokens * h * model.ffn_size * (3 if gated else 2) // 2
    d_in = hybrid.EXPAND * h  # Megatron's formula, whatever mamba_num_heads says
    heads = model.mamba_num_heads or d_in // model.mamba_headdim
    mamba = (2 * tokens * h * (2 * d_in + 2 * model.mamba_groups * model.mamba_state + heads)
             + 7 * tokens * d_in * model.mamba_state + 2 * tokens * d_in * h)
    logits = 2 * tokens * h * model.padded_vocab_size(tensor_parallel)
    return (counts[hybrid.ATTENTION] * attention + counts[hybrid.MLP] * mlp + counts[hybrid.MAMBA] * mamba
            + logits)
