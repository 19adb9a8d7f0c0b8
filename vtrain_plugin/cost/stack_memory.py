"""What the software stack changes in the memory the trace measured (:mod:`vtrain_plugin.cost.memory`).

The trace records megatron-core's local spec on the CPU; on a GPU every stack keeps its dropout
masks as one byte per element (:mod:`~vtrain_plugin.cost.lowering.dropout_masks`), and Megatron's
fused softmax (``megatron_deepspeed_2023``; TE's unfused attention alike) its output in the model
dtype (:func:`~vtrain_plugin.cost.lowering.megatron_core_te.fused_softmax_saved_delta`); Megatron-Core's
stacks run their norms fused, keeping the input and fp32 row statistics where the traced composite
RMSNorm kept two fp32 copies of its input (:mod:`~vtrain_plugin.cost.lowering.fused_norms`). A stack with
fused attention (``megatron_core_te`` unless ``training.unfused_attention``)
keeps no score-sized tensors for backward (:func:`~vtrain_plugin.cost.lowering.megatron_core_te.fused_attention_saved_delta`:
one layer's activations go from quadratic to linear in the sequence length) and no causal mask (the
local spec's softmax keeps the ``s x s`` mask the layers of a chunk share, traced as the stage block
:data:`~megatron_adapters.conventions.SHARED_BY_CORE_ATTENTION`; TransformerEngine's causal kernels
take no mask, while a checkpoint around the attention or the layer keeps it as an input and its
bytes stay with the chunk); its fused norms and activation functions, and in FP8 its linears, keep
what :func:`~vtrain_plugin.cost.lowering.te_saved.te_saved_delta` says.

TransformerEngine in FP8 (or FP4) keeps a quantised copy of each linear weight and its transpose
(the dgrad GEMM reads it on Hopper), with their block scales
(:class:`~vtrain_plugin.cost.lowering.fp8.Quantisation`), across the micro-batches of an iteration
(:func:`~vtrain_plugin.cost.lowering.fp8.fp8_weight_numel`), counted with the weights. With
``fp8_param_gather`` those FP8 weights are the parameters themselves (TE's ``Float8Tensor``, one
byte per element, its transpose kept beside it, Megatron-Core's ``post_all_gather_processing``): the
linear weights have no model-dtype copy (their fp32 main weights are the optimizer's, as always).
What the traced step holds beside its saved activations and what its backward adds at its peak
(megatron-core's global buffer of attention scores, a recomputed layer, score-sized gradients, the
logits' gradient) count for every stack; TransformerEngine's fused attention has neither the buffer
nor the score-sized tensors, so with it they are those measured outside the core attention (the
fused kernel's own gradients of queries, keys and values, as large as its inputs, are left out);
TE's unfused attention holds no score buffer either (its scores are a fresh tensor freed after the
softmax) and adds in backward the score-sized gradient of
:func:`~vtrain_plugin.cost.lowering.megatron_core_te.unfused_backward_score_nbytes`; megatron-core's
fused cross entropy holds :func:`~vtrain_plugin.cost.lowering.cross_entropy.fused_cross_entropy_forward_nbytes`
beside the stash in its forward on the stage of the loss (the step's peak where that is more than the
backward's), and the output layer's deferred weight gradients
:func:`~vtrain_plugin.cost.lowering.cross_entropy.deferred_wgrad_nbytes`.
The GEMM libraries' cuBLAS workspaces of the GPU's generation are
:func:`~vtrain_plugin.cost.workspaces.workspace_nbytes`'s.
CUDA graphs add their static buffers to the allowance (:func:`~vtrain_plugin.cost.cuda_graphs.graph_pool_gib`).
Activation offloading moves what :func:`~vtrain_plugin.cost.activation_offload.offloaded_nbytes` says
of each layer to host memory, less one layer's worth per rank that megatron-core keeps, and brings
back at most one layer instance's worth during that layer's backward (the group back-propagating
and the one reloaded ahead of it), counted at that block's moment of the backward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields, replace
from operator import attrgetter

from megatron_adapters.conventions import SHARED_BY_CORE_ATTENTION
from vtrain_plugin.core.graph import Block, OpGraph, StageGraph
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.activation_offload import offloaded_nbytes
from vtrain_plugin.cost.cuda_graphs import captured_apart, captured_saved_nbytes, captures_attention, graph_pool_gib
from vtrain_plugin.cost.lowering.mamba import mixer_dims, mixer_saved_delta
from vtrain_plugin.cost.lowering.fp8 import fp8_weight_numel, quantisation
from vtrain_plugin.cost.lowering.cross_entropy import deferred_wgrad_nbytes, fused_cross_entropy_forward_nbytes
from vtrain_plugin.cost.lowering.dropout_masks import dropout_mask_delta
from vtrain_plugin.cost.lowering.fused_norms import fused_norm_saved_delta
from vtrain_plugin.cost.lowering.megatron_core_te import (fused_attention_saved_delta, fused_softmax_saved_delta,
                                                         unfused_backward_score_nbytes)
from vtrain_plugin.cost.memory import FRAGMENTATION, PeakLive, RankMemory, alike_ranks, rank_memory
from vtrain_plugin.cost.lowering.te_saved import te_saved_delta
from vtrain_plugin.cost.workspaces import workspace_nbytes
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

_DELTA_CACHE_SIZE = 1024
# What a block's stack keeps minus what its trace did, by the identity of the block's nodes and
# saved_by_module tuples; the entry holds both, so no other tuple can take their id while it lives.
_deltas: OrderedDict[tuple, tuple[int, tuple, tuple]] = OrderedDict()


_MEMORY_CACHE_SIZE = 64
# The fields of a training spec memory reads: all but when gradients are reduced and parameters gathered
_AS_READ = attrgetter(*(f.name for f in fields(TrainingSpec) if f.name not in ("grad_reduce", "overlap_param_gather")))
# Results by the identity of the graph and of the schedule whose peak_live they walked (the entry
# holds both), the stack, the training spec as memory reads it and the architecture.
_memories: OrderedDict[tuple, tuple[OpGraph, object, tuple[RankMemory, ...]]] = OrderedDict()


def stack_rank_memory(graph: OpGraph, peak_live: PeakLive, stack: SoftwareStack,
                      training: TrainingSpec | None = None,
                      architecture: GpuArchitecture | None = None) -> tuple[RankMemory, ...]:
    """:func:`~vtrain_plugin.cost.memory.rank_memory` of ``graph`` as ``stack`` runs it with the
    options of ``training`` (FP8, FP8 weights, gradient dtype, distributed optimizer; None: none) on
    a GPU of ``architecture`` (its GEMM workspaces; None: none counted).

    The plans of a search that share a graph and a schedule and differ only in when gradients are
    reduced and parameters gathered (``grad_reduce``, ``overlap_param_gather``: memory reads
    neither) share the result, looked up."""
    schedule = getattr(peak_live, "__self__", None)
    if schedule is None:
        return _stack_rank_memory(graph, peak_live, stack, training, architecture)
    key = (id(graph), id(schedule), stack, None if training is None else _AS_READ(training), architecture)
    hit = _memories.get(key)
    if hit is not None and hit[0] is graph and hit[1] is schedule:
        _memories.move_to_end(key)
        return hit[2]
    memory = _stack_rank_memory(graph, peak_live, stack, training, architecture)
    _memories[key] = (graph, schedule, memory)
    if len(_memories) > _MEMORY_CACHE_SIZE:
        _memories.popitem(last=False)
    return memory


def _stack_rank_memory(graph: OpGraph, peak_live: PeakLive, stack: SoftwareStack, training: TrainingSpec | None,
                       architecture: GpuArchitecture | None) -> tuple[RankMemory, ...]:
    graph, ranks = alike_ranks(graph)  # from here on the stages of one rank of each kind
    settings = None if training is None else training.fp8_settings
    fp8 = settings is not None
    quantised = quantisation(settings) if fp8 else None
    attention_delta = (fused_softmax_saved_delta if training is not None and training.unfused_attention
                       else fused_attention_saved_delta)
    offload = None if training is None else training.activation_offload
    moved = [[0.0 for _ in stage.blocks] for stage in graph.stages]  # per stage and block instance
    reloaded: dict[tuple[int, int, str], float] = {}  # by (pipeline rank, chunk, block name): per instance
    if offload is not None:
        unfused = training.unfused_attention
        moved = [[offloaded_nbytes(block, offload, te=stack is SoftwareStack.MEGATRON_CORE_TE,
                                   element_nbytes=graph.dtype.nbytes, fp8=fp8, unfused_attention=unfused,
                                   quantised_nbytes=quantised.nbytes if fp8 else 1.0) for block in stage.blocks]
                 for stage in graph.stages]
        reloaded = {(stage.pipeline_rank, stage.chunk, block.name): nbytes
                    for stage, row in zip(graph.stages, moved) for block, nbytes in zip(stage.blocks, row)}
        graph = replace(graph, stages=tuple(
            replace(stage, blocks=tuple(replace(block, activation_nbytes=block.activation_nbytes - round(nbytes))
                                        for block, nbytes in zip(stage.blocks, moved[i])))
            for i, stage in enumerate(graph.stages)))
    te = stack is SoftwareStack.MEGATRON_CORE_TE
    quantised_nbytes = quantised.nbytes if fp8 else 1.0
    # megatron-core's norms on a GPU are fused (TE's, apex's, torch's RMSNorm on CUDA); on the CPU the
    # local spec runs torch's composite RMSNorm as traced
    gpu = architecture is not None and architecture is not GpuArchitecture.CPU
    fused_norms = gpu

    def saved_delta(block: Block) -> int:  # what the stack keeps per instance minus what the trace did
        # it reads the block's nodes and saved_by_module only: stages of one chunk role (and the
        # plans of one shape) share those tuples, so it is computed once per role (see _deltas)
        key = (id(block.nodes), id(block.saved_by_module), stack, fp8, quantised_nbytes, attention_delta, fused_norms)
        known = _deltas.get(key)
        if known is not None:
            _deltas.move_to_end(key)
            return known[0]
        delta = dropout_mask_delta(block)
        if stack is SoftwareStack.MEGATRON_DEEPSPEED_2023:
            delta += fused_softmax_saved_delta(block.nodes)
        elif fused_norms and not te:  # TE's norms are in te_saved_delta
            delta += fused_norm_saved_delta(block)
        if te:
            delta += (attention_delta(block.nodes) + mixer_saved_delta(block, mixer_dims(block.nodes))
                      + te_saved_delta(block, fp8=fp8, quantised_nbytes=quantised_nbytes))
        _deltas[key] = (delta, block.nodes, block.saved_by_module)
        if len(_deltas) > _DELTA_CACHE_SIZE:
            _deltas.popitem(last=False)
        return delta

    adjusted: dict[int, tuple[Block, ...]] = {}  # by the stage's blocks tuple, which a role's stages share

    def stack_blocks(blocks: tuple[Block, ...]) -> tuple[Block, ...]:
        known = adjusted.get(id(blocks))
        if known is None:
            known = adjusted[id(blocks)] = tuple(
                replace(block, activation_nbytes=block.activation_nbytes + saved_delta(block))
                for block in blocks if not (te and block.name == SHARED_BY_CORE_ATTENTION))
        return known

    graph = replace(graph, stages=tuple(replace(stage, blocks=stack_blocks(stage.blocks)) for stage in graph.stages))
    fsdp = None if training is None else training.fsdp

    def memory_of(walked: OpGraph, extra: Callable[[StageGraph], list[int]],
                  forward: Callable[[StageGraph], int] | None) -> tuple[RankMemory, ...]:
        return rank_memory(walked, peak_live,
                           distributed_optimizer=training is not None and training.distributed_optimizer,
                           gradients=None if training is None else training.grad_dtype(graph.dtype), fsdp=fsdp,
                           optimizer=None if training is None else training.optimizer,
                           backward_peaks=True, fused_attention=te, block_extra=extra, forward_extra=forward,
                           gpu_softmax=gpu and stack is SoftwareStack.LOCAL_SPEC,
                           ranks=ranks)

    def cross_entropy(stage: StageGraph) -> int:
        return _forward_extra(graph, stage, training)

    if training is not None and captured_apart(training):
        # the captured parts' saves count while the graphs are captured, the rest while they replay
        captured = [[min(block.activation_nbytes, captured_saved_nbytes(
            block, training, te=te, fp8=fp8, quantised_nbytes=quantised_nbytes)) for block in stage.blocks]
            for stage in graph.stages]
        attention = captures_attention(training)
        unfused = te and training.unfused_attention and attention
        capture = memory_of(_saved_by_walk(graph, captured, captured=True),
                            lambda stage: [unfused_backward_score_nbytes(b.nodes) if unfused else 0
                                           for b in stage.blocks], None)
        replay = memory_of(_saved_by_walk(graph, captured, captured=False),
                           lambda stage: _block_extra(graph, stage, te, training, reloaded, attention_captured=attention),
                           cross_entropy)
        memory = tuple(max(r, c, key=lambda m: m.activations_gib) for r, c in zip(replay, capture))
    else:
        memory = memory_of(graph, lambda stage: _block_extra(graph, stage, te, training, reloaded), cross_entropy)
    pp = graph.parallel.pipeline_parallel
    kept = [0.0] * pp  # offloading: the last group of each name stays, one layer's bytes per rank
    if offload is not None:
        for stage, nbytes in zip(graph.stages, moved):
            kept[stage.pipeline_rank] = max(kept[stage.pipeline_rank], *nbytes, 0.0)
    workspaces = workspace_nbytes(graph, stack, architecture,
                                  tp_comm_overlap=training is not None and training.tp_comm_overlap)
    pools = None if training is None else graph_pool_gib(graph, training)
    per_element = 0.0
    linear = [0] * pp  # elements of the linear weights TE keeps FP8 copies of
    if fp8:
        # per element of a linear weight: its quantised copy and transpose with their scales, less its
        # model-dtype copy when the FP8 copy is the parameter itself
        per_element = 2 * quantised.weight_nbytes - (graph.dtype.nbytes if training.fp8_param_gather else 0)
        if fsdp is not None and fsdp.sharding_strategy.shards_parameters:
            # FSDP keeps the shard only: quantised instead of the model dtype with fp8_param_gather; TE's
            # quantised copies and transposes of a gathered unit live while it computes (not counted)
            shards = graph.parallel.grad_reduce_group_size
            per_element = (quantised.weight_nbytes - graph.dtype.nbytes) / shards if training.fp8_param_gather else 0
        for stage in graph.stages:
            linear[stage.pipeline_rank] += sum(b.count * fp8_weight_numel(b.nodes) for b in stage.blocks)
    finished: dict[int, RankMemory] = {}  # by the identity of rank_memory's result, which alike ranks share

    def finish(m: RankMemory, alike: int) -> RankMemory:  # what the stack adds on ranks of alike's kind
        activations, allowance, weights = m.activations_gib, m.allowance_gib, m.weights_gib
        if offload is not None:
            activations += kept[alike] / GIB
            allowance += FRAGMENTATION * kept[alike] / GIB
        if pools is not None:
            allowance += pools[alike]
        if fp8:
            weights += per_element * linear[alike] / GIB
        return RankMemory(weights_gib=weights, gradients_gib=m.gradients_gib, optimizer_gib=m.optimizer_gib,
                          activations_gib=activations, inflight_microbatches=m.inflight_microbatches,
                          workspaces_gib=workspaces[alike] / GIB, allowance_gib=allowance)

    out = []
    for m, alike in zip(memory, ranks):
        done = finished.get(id(m))
        if done is None:
            done = finished[id(m)] = finish(m, alike)
        out.append(done)
    return tuple(out)


def _saved_by_walk(graph: OpGraph, captured_nbytes: list[list[int]], *, captured: bool) -> OpGraph:
    """``graph`` with each block keeping only the bytes a CUDA graph captured (``captured_nbytes``,
    per stage and block) or only the rest; the captured walk has no traced transient."""
    stages = []
    for stage, nbytes in zip(graph.stages, captured_nbytes):
        blocks = tuple(replace(b, activation_nbytes=n if captured else b.activation_nbytes - n)
                       for b, n in zip(stage.blocks, nbytes))
        stages.append(replace(stage, blocks=blocks) if not captured else replace(
            stage, blocks=blocks, held_nbytes=0, backward_peak_nbytes=0, held_outside_attention_nbytes=0,
            backward_peak_outside_attention_nbytes=0, gpu_softmax_backward_peak_nbytes=0))
    return replace(graph, stages=tuple(stages))


def _block_extra(graph: OpGraph, stage: StageGraph, te: bool, training: TrainingSpec | None,
                 reloaded: dict[tuple[int, int, str], float], *, attention_captured: bool = False) -> list[int]:
    """What the stack holds beyond the traced ops in the backward of each block of ``stage``: TE's
    unfused attention's score gradient (unless a CUDA graph captured it, see
    :func:`stack_rank_memory`); the tensors activation offloading brought back for the instance
    back-propagating and the group reloaded ahead of it, at most one instance's offloaded bytes
    (``reloaded``, per instance by rank, chunk and block name); with the output layer's deferred
    weight gradients, those of the earlier micro-batches, beside every block."""
    if training is None:
        return [0] * len(stage.blocks)
    deferred = 0
    if training.defer_embedding_wgrad:
        plan = graph.parallel
        microbatches = training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
        deferred = sum(deferred_wgrad_nbytes(b, graph.dtype.nbytes, microbatches, training.wgrad_deferral_limit)
                       for b in stage.blocks)
    unfused = te and training.unfused_attention and not attention_captured
    return [deferred + (unfused_backward_score_nbytes(b.nodes) if unfused else 0)
            + round(reloaded.get((stage.pipeline_rank, stage.chunk, b.name), 0.0)) for b in stage.blocks]


def _forward_extra(graph: OpGraph, stage: StageGraph, training: TrainingSpec | None) -> int:
    """What megatron-core's fused cross entropy holds beside the stash of ``stage`` in its forward."""
    if training is None or not training.cross_entropy_fusion:
        return 0
    return max((fused_cross_entropy_forward_nbytes(b.nodes, graph.dtype.nbytes) for b in stage.blocks), default=0)
