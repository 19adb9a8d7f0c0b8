"""Megatron-Core's conventions that vtrain relies on: the module paths of a GPT model and the rank order.

Tracing reads a megatron-core model by the names of its modules (which block an op belongs to, which
parameter is the word embedding), costing attributes the collectives Megatron's runtime adds to
those modules and places every rank on a node as Megatron numbers them, and the adapters build the
model and its process groups. All of them follow Megatron-Core, not one another, so its conventions
are written down once, here, with the rest of what knows Megatron (DESIGN.md, "Layout"): a
megatron-core release that renames a module or reorders its ranks is followed in this file alone.
This module imports nothing from megatron-core, so capture and cost read it without loading Megatron.

Module paths (megatron-core 0.16 ``GPTModel``, as ``named_modules`` spells them): the embedding
(word and learned position embeddings) on the first stage, the transformer layers
``decoder.layers.<i>`` (the index local to the model chunk), and the head on the last stage: the
final layer norm, the output layer and the loss.

Rank order: megatron-core numbers global ranks in the order ``tp-cp-ep-dp-pp``
(``initialize_model_parallel``'s default ``order``), the first dimension varying fastest, and the
launcher fills nodes in rank order. :data:`RANK_ORDER` holds tensor, context, data and pipeline
parallelism; adding another means inserting it at its place in :data:`RANK_ORDER`, and every function
below follows. Expert parallelism does not add ranks: the MoE layers' groups come from a second
numbering of the same ranks with the same order (its own rank generator: expert TP, EP, expert DP,
PP; no CP, so an expert group spans the TP x CP x DP ranks of a pipeline stage),
:data:`EXPERT_RANK_ORDER`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import ParallelGroup
from vtrain_plugin.specs.parallel import ParallelPlan

# -- module paths -----------------------------------------------------------------------------------

EMBEDDING = "embedding"  # LanguageModelEmbedding; every module under it is the embedding's
WORD_EMBEDDING = "embedding.word_embeddings"
FINAL_LAYERNORM = "decoder.final_layernorm"
OUTPUT_LAYER = "output_layer"
LOSS = "loss"  # not megatron-core's: megatron_adapters.gpt gives GPTModel's loss computation this name
FINAL_NORM = "decoder.final_norm"  # a Mamba hybrid's (MambaStack's) final norm
# Multi-token prediction (megatron-core's MultiTokenPredictionBlock, ``mtp.layers.<i>``): built on the
# last stage with the output layer, once per model, so it belongs to the head, not to the folded layers.
MTP = "mtp"
HEAD_MODULES = (FINAL_LAYERNORM, FINAL_NORM, OUTPUT_LAYER, LOSS, MTP)
# A layer's core attention (DotProductAttention in the local spec: scores, softmax, dropout, context;
# TransformerEngine's fused attention in the TE spec), under the layer: ``<layer>.self_attention.core_attention``.
CORE_ATTENTION = ".self_attention.core_attention"
# Not a module of megatron-core's: the owner tracing gives a tensor that the core attention of several
# layers keeps for backward (the causal attention mask of the local spec's softmax), which a fused
# attention kernel does not keep; it is a block of the stage of its own.
SHARED_BY_CORE_ATTENTION = "<kept by the core attention of every layer>"
TIED_WEIGHT_OWNERS = (WORD_EMBEDDING, OUTPUT_LAYER)  # one tensor with share_embeddings_and_output_weights

# ``<prefix>.layers.<index><rest>``, the prefix ending in ``layers`` (``decoder.layers``, or ``layers``
# alone) and ``rest`` empty or starting with a dot; when layers nest, the innermost index is the one.
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)(?P<rest>(?:\..*)?)$")


def split_layer_module(name: str) -> tuple[str, int, str] | None:
    """``(prefix, index, rest)`` of a module in a transformer layer, ``None`` for any other module.

    ``decoder.layers.3.mlp.linear_fc1`` splits into ``("decoder.layers", 3, ".mlp.linear_fc1")``
    and the layer itself, ``decoder.layers.3``, into ``("decoder.layers", 3, "")``: ``rest`` keeps
    its leading dot, and ``f"{prefix}.{index}"`` names the layer. The MTP layers (``mtp.layers.0``)
    are the head's (:data:`MTP`): None.
    """
    if name == MTP or name.startswith(MTP + "."):  # the head's MTP layers (see MTP)
        return None
    m = _LAYER.match(name)
    return (m.group("prefix"), int(m.group("index")), m.group("rest")) if m else None


def is_expert_parallel_parameter(param) -> bool:
    """Whether megatron-core's DDP reduces ``param``'s gradient over the expert data-parallel group
    rather than the data-parallel one: its linear layers mark the weights of experts split by expert
    parallelism (EP > 1) ``allreduce = False``."""
    return not getattr(param, "allreduce", True)


_MLP = re.compile(r"\.mlp(?:\.experts\.local_experts\.\d+)?$")


def is_mlp_module(name: str) -> bool:
    """Whether ``name`` is the module that runs an MLP's activation: a dense layer's ``mlp``, or one
    of the local experts of a MoE layer's ``SequentialMLP`` (``...mlp.experts.local_experts.0``)."""
    return _MLP.search(name) is not None


def is_expert_module(name: str) -> bool:
    """Whether ``name`` is one of a MoE layer's experts or a module inside one
    (``decoder.layers.3.mlp.experts.local_experts.0.linear_fc1``)."""
    return ".mlp.experts." in f"{name}."


def is_layer_module(name: str) -> bool:
    """Whether ``name`` is a transformer layer or a module inside one."""
    return split_layer_module(name) is not None


def is_core_attention_module(name: str) -> bool:
    """Whether ``name`` is a layer's core attention or a module inside it (its softmax, its dropout)."""
    if name.startswith(MTP + "."):  # an MTP layer's transformer layer: mtp.layers.<i>.transformer_layer...
        return CORE_ATTENTION in name
    split = split_layer_module(name)
    return split is not None and (split[2] == CORE_ATTENTION or split[2].startswith(CORE_ATTENTION + "."))


def traced_nope_layers(count: int, mixed: bool) -> tuple[bool, ...]:
    """Which of a chunk's ``count`` traced layers are built without the rotary embedding, for a model
    with NoPE layers: RoPE, NoPE, RoPE, ... when the model mixes the two (the tracer then builds at
    least two layers, one of each), else every one. :mod:`megatron_adapters.gpt` builds them so and
    :func:`vtrain_plugin.capture.folding.fold_nope_kinds` folds them so."""
    return tuple(i % 2 == 1 for i in range(count)) if mixed else (True,) * count


def is_embedding_module(name: str) -> bool:
    return name.startswith(EMBEDDING)


def is_head_module(name: str) -> bool:
    return name.startswith(HEAD_MODULES)


# -- model chunks -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkRole:
    """The model chunk a pipeline rank holds: ``pre_process`` (the embedding) on the first chunk of
    the first rank, ``post_process`` (the head) on the last chunk of the last rank."""

    pipeline_rank: int
    chunk: int
    pre_process: bool
    post_process: bool


def chunk_role(plan: ParallelPlan, pipeline_rank: int, chunk: int) -> ChunkRole:
    return ChunkRole(
        pipeline_rank=pipeline_rank,
        chunk=chunk,
        pre_process=pipeline_rank == 0 and chunk == 0,
        post_process=pipeline_rank == plan.pipeline_parallel - 1 and chunk == plan.virtual_pipeline - 1,
    )


# -- rank order -------------------------------------------------------------------------------------

RANK_ORDER: tuple[ParallelGroup, ...] = (ParallelGroup.TP, ParallelGroup.CP, ParallelGroup.DP,
                                         ParallelGroup.PP)  # fastest first
EXPERT_RANK_ORDER: tuple[ParallelGroup, ...] = (ParallelGroup.EXPERT_TP, ParallelGroup.EP, ParallelGroup.EXPERT_DP,
                                                ParallelGroup.PP)
# Megatron-LM's --use-tp-pp-dp-mapping: initialize_model_parallel(order="tp-cp-ep-pp-dp"), pipeline
# before data parallelism, in both numberings.
TP_PP_DP_RANK_ORDER: tuple[ParallelGroup, ...] = (ParallelGroup.TP, ParallelGroup.CP, ParallelGroup.PP,
                                                  ParallelGroup.DP)
TP_PP_DP_EXPERT_RANK_ORDER: tuple[ParallelGroup, ...] = (ParallelGroup.EXPERT_TP, ParallelGroup.EP, ParallelGroup.PP,
                                                         ParallelGroup.EXPERT_DP)


def rank_strides(sizes: Mapping[ParallelGroup, int], order: tuple[ParallelGroup, ...] = RANK_ORDER
                 ) -> dict[ParallelGroup, int]:
    """How far apart in global rank two ranks are that differ by one along each dimension.

    ``sizes`` maps each dimension to its parallel size; one it leaves out has size 1. The stride of
    a dimension is the product of the sizes of the dimensions before it in ``order``
    (:data:`RANK_ORDER`, or :data:`EXPERT_RANK_ORDER` for the groups of MoE layers).
    """
    strides: dict[ParallelGroup, int] = {}
    stride = 1
    for dim in order:
        strides[dim] = stride
        stride *= sizes.get(dim, 1)
    return strides


def global_rank(coordinates: Mapping[ParallelGroup, int], sizes: Mapping[ParallelGroup, int],
                order: tuple[ParallelGroup, ...] = RANK_ORDER) -> int:
    """The global rank of the rank at ``coordinates`` (its rank along each dimension, 0 for one left out)."""
    unknown = set(coordinates) - set(order)
    if unknown:
        raise ConfigError(f"ranks are numbered along {', '.join(order)}, not {', '.join(sorted(unknown))}")
    strides = rank_strides(sizes, order)
    rank = 0
    for dim in order:
        r, size = coordinates.get(dim, 0), sizes.get(dim, 1)
        if not 0 <= r < size:
            raise ConfigError(f"{dim}_rank must be in [0, {size}), got {r}")
        rank += r * strides[dim]
    return rank


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node of global rank ``rank``: the launcher fills nodes in rank order."""
    return rank // gpus_per_node
