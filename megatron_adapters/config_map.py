"""Map a megatron-core ``TransformerConfig`` onto vtrain's ModelSpec (read by attribute, so no
megatron type leaks out)."""

from __future__ import annotations

from typing import Any

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.specs.model import Family, ModelSpec


def model_spec_from_transformer_config(config: Any, *, vocab_size: int, seq_length: int) -> ModelSpec:
    """A ModelSpec for a megatron-core TransformerConfig built with the local layer spec."""
    llama = getattr(config, "normalization", "LayerNorm") == "RMSNorm" or getattr(config, "gated_linear_unit", False)
    dtype = Dtype.BF16 if getattr(config, "bf16", False) else Dtype.FP16 if getattr(config, "fp16", False) else Dtype.FP32
    return ModelSpec(
        family=Family.LLAMA if llama else Family.GPT,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        seq_length=seq_length,
        vocab_size=vocab_size,
        dtype=dtype,
    )
