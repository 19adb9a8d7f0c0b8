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
"""

from __future__ import annotations

import warnings

from megatron_adapters.gpt import _cast_parameters, torch_dtype, transformer_config
from megatron_adapters.conventions import ChunkRole
from vtrain_plugin.specs.hybrid import traced_kinds
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

_POSITION_EMBEDDING = {Family.GPT: "learned_absolute", Family.LLAMA: "rope"}


def hybrid_config_fields(model: ModelSpec) -> dict:
    """The TransformerConfig fields of a hybrid (none for a transformer)."""
    if not model.is_hybrid:
        return {}
    return dict(is_hybrid_model=True, mamba_state_dim=model.mamba_state, mamba_head_dim=model.mamba_headdim,
                mamba_num_groups=model.mamba_groups, mamba_num_heads=model.mamba_num_heads)


def build_hybrid_chunk(model: ModelSpec, plan: ParallelPlan, role: ChunkRole):
    """Build the MambaModel chunk of ``role`` with one layer of each kind of ``model``'s pattern
    (call inside fake_world and FakeTensorMode; ``plan`` is the trace world's)."""
    from megatron.core.models.mamba import MambaModel

    from megatron_adapters.stand_ins import hybrid_stack_spec

    kinds = traced_kinds(model.hybrid_layer_pattern or "")
    config = transformer_config(model, plan, layers_per_chunk=len(kinds))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mamba = MambaModel(
            config=config,
            mamba_stack_spec=hybrid_stack_spec(),
            vocab_size=model.padded_vocab_size(plan.tensor_parallel),
            max_sequence_length=model.seq_length,
            pre_process=role.pre_process,
            post_process=role.post_process,
            hybrid_override_pattern=kinds * plan.pipeline_parallel,
            share_embeddings_and_output_weights=model.tied,
            position_embedding_type=_POSITION_EMBEDDING[model.family],
        )
    _cast_parameters(mamba, torch_dtype(model.dtype))
    return mamba
