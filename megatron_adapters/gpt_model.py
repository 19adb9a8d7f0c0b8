"""A megatron-core ``GPTModel`` a training script built, read as the ModelSpec vtrain traces.

The script's model is one rank's shard for the layout its process groups have; vtrain estimates
any plan, so it rebuilds the model from what the GPTModel was built with (its TransformerConfig,
vocabulary, position embedding and embedding tying) for the plan asked, on a fake process group,
and never runs, copies or pickles the script's model (megatron-core modules hold its process
groups). The wrappers a training script puts around the model (megatron-core's and torch's
DistributedDataParallel, Float16Module, Megatron-LM's list of model chunks) are looked through.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from megatron_adapters.config_map import model_spec_from_transformer_config
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.model_features import POSITIONS_NOT_MODELLED, not_modelled


def find_built_model(model: Any, package: str, class_name: str) -> Any | None:
    """The megatron-core model of class ``package.class_name`` that ``model`` is or wraps (the first
    chunk of a list of chunks), else None; None too when ``package`` was never imported (no such
    model was built in this process)."""
    if package not in sys.modules:
        return None
    cls = getattr(sys.modules[package], class_name)
    if isinstance(model, (list, tuple)) and model:
        chunks = [find_built_model(chunk, package, class_name) for chunk in model]
        return chunks[0] if all(chunk is not None for chunk in chunks) else None
    wrappers = _wrapper_types()
    while isinstance(model, wrappers):
        model = model.module
    return model if isinstance(model, cls) else None


def find_gpt_model(model: Any) -> Any | None:
    """The megatron-core GPTModel ``model`` is or wraps (the first chunk of a list of chunks), else None."""
    return find_built_model(model, "megatron.core.models.gpt", "GPTModel")


def _wrapper_types() -> tuple[type, ...]:
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    return (DistributedDataParallel, Float16Module, torch.nn.parallel.DistributedDataParallel)


def model_spec_of_gpt_model(gpt: Any, *, seq_length: int) -> ModelSpec:
    """The ModelSpec of a built GPTModel: its config's fields (as for a bare TransformerConfig, with
    the same refusals), its vocabulary, embedding tying, position embedding and rotary share."""
    model = model_spec_from_transformer_config(gpt.config, vocab_size=gpt.vocab_size, seq_length=seq_length)
    positions = gpt.position_embedding_type
    if positions in POSITIONS_NOT_MODELLED:
        raise not_modelled(f"GPTModel.position_embedding_type={positions!r}", POSITIONS_NOT_MODELLED[positions])
    return replace(model, tied_embeddings=bool(gpt.share_embeddings_and_output_weights),
                   position_embedding_type=positions, rotary_percent=float(getattr(gpt, "rotary_percent", 1.0)))
