"""Build one chunk of a megatron-core MambaModel (a Mamba hybrid) from a ModelSpec.

The chunk is megatron-core's own ``MambaModel`` over :func:`megatron_adapters.stand_ins.hybrid_stack_spec`
(local modules, the Mamba mixer a stand-in doing the Mamba-2 math in torch ops), with
gpt.py's TransformerConfig plus the hybrid fields; the training step is gpt.py's, the one every
chunk runs.

Why one layer of each kind: the layers of a hybrid stage differ (``M``, ``*``, ``-`` interleave),
but the layers of one kind are alike, so a chunk is traced with one layer of each kind the model
has (:func:`vtrain_plugin.specs.hybrid.traced_kinds`) and each stage counts its own
(:func:`vtrain_plugin.capture.folding.fold_hybrid_layers`). megatron-core selects a pipeline
rank's layers from the pattern itself: the trace world's pattern repeats the traced kinds once per
trace stage, so every rank builds exactly those layers.

A MambaModel a training script built is read as the ModelSpec it describes
(:func:`model_spec_of_mamba_model`), as gpt_model.py reads a GPTModel.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

from megatron_adapters.config_map import model_spec_from_transformer_config
from megatron_adapters.conventions import ChunkRole
from megatron_adapters.gpt import _cast_parameters, torch_dtype, transformer_config
from vtrain_plugin.specs.hybrid import traced_kinds
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.model_features import unmodelled_warning
from vtrain_plugin.specs.parallel import ParallelPlan

log = logging.getLogger(__name__)

_POSITION_EMBEDDING = {Family.GPT: "learned_absolute", Family.LLAMA: "rope"}


def hybrid_config_fields(model: ModelSpec) -> dict:
    """The TransformerConfig fields of a hybrid (none for a transformer)."""
    if not model.is_hybrid:
        return {}
    return dict(is_hybrid_model=True, mamba_state_dim=model.mamba_state, mamba_head_dim=model.mamba_headdim,
                mamba_num_groups=model.mamba_groups, mamba_num_heads=model.mamba_num_heads)


def build_hybrid_chunk(model: ModelSpec, plan: ParallelPlan, role: ChunkRole):
    """Build the MambaModel chunk of ``role`` with one layer of each kind of ``model``'s pattern
    (call inside fake_world and FakeTensorMode; ``plan`` is the trace world's); its MoE layers (``E``)
    as :func:`megatron_adapters.gpt.build_chunk` prepares a GPT's."""
    from megatron.core.models.mamba import MambaModel

    from megatron_adapters.stand_ins import hybrid_stack_spec

    kinds = traced_kinds(model.hybrid_layer_pattern or "")
    config = transformer_config(model, plan, layers_per_chunk=len(kinds))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mamba = MambaModel(
            config=config,
            mamba_stack_spec=hybrid_stack_spec(num_experts=model.num_experts),
            vocab_size=model.padded_vocab_size(plan.tensor_parallel),
            max_sequence_length=model.seq_length,
            pre_process=role.pre_process,
            post_process=role.post_process,
            hybrid_override_pattern=kinds * plan.pipeline_parallel,
            share_embeddings_and_output_weights=model.tied,
            position_embedding_type=_POSITION_EMBEDDING[model.family],
        )
    _cast_parameters(mamba, torch_dtype(model.dtype))
    if model.is_moe:  # E layers: megatron-core's MoE layer, its dispatcher under the routing assumption
        from megatron_adapters.flex_routing import flex_dispatch
        from megatron_adapters.moe import prepare_moe_layers

        prepare_moe_layers(mamba, model.moe_routing_skew, flex_dispatch(model, plan))
    return mamba


# -- a MambaModel a training script built ------------------------------------------------------------


def find_mamba_model(model: Any) -> Any | None:
    """The megatron-core MambaModel ``model`` is or wraps (the first chunk of a list), else None."""
    from megatron_adapters.gpt_model import find_built_model

    return find_built_model(model, "megatron.core.models.mamba", "MambaModel")


def model_spec_of_mamba_model(mamba: Any, *, seq_length: int) -> ModelSpec:
    """The ModelSpec of a built MambaModel: its config's fields (as for a TransformerConfig, with the
    same refusals), the whole model's layer pattern as megatron-core allocates it (from the override
    pattern or the ratios), its vocabulary and embedding tying. A position embedding other than the
    family's is noted, as on the other input paths."""
    from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

    pattern = "".join(allocate_layers(mamba.config.num_layers, mamba.hybrid_attention_ratio, mamba.hybrid_mlp_ratio,
                                      mamba.hybrid_override_pattern))
    model = model_spec_from_transformer_config(mamba.config, vocab_size=mamba.vocab_size, seq_length=seq_length,
                                               hybrid_layer_pattern=pattern)
    want = _POSITION_EMBEDDING[model.family]
    if mamba.position_embedding_type != want:
        log.warning("warning: %s", unmodelled_warning("MambaModel arguments", [
            f"position_embedding_type={mamba.position_embedding_type!r} (vtrain's {model.family.value} layers: "
            f"{want!r})"]))
    return replace(model, tied_embeddings=bool(mamba.share_embeddings_and_output_weights))
