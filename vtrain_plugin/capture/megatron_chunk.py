"""Tracing one megatron-core model chunk on a fake process group: the part of ``trace()`` that
needs torch and megatron-core. The tracer imports this module only when a chunk is in neither its
in-process nor its on-disk cache, so estimating a plan traced before loads neither.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_adapters.conventions import TIED_WEIGHT_OWNERS, ChunkRole, is_expert_parallel_parameter
from megatron_adapters.cpu_patches import cpu_tracing_patches
from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
from megatron_adapters.gpt import build_chunk, prepare_for_recording, run_training_step, stage_input_shape
from vtrain_plugin.capture import folding
from vtrain_plugin.capture.chunk import ChunkTrace
from vtrain_plugin.capture.recorder import OpRecorder
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import TraceError
from vtrain_plugin.core.graph import ParallelGroup
from vtrain_plugin.specs.attention import mixes_nope, mixes_windows
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

log = logging.getLogger(__name__)


def trace_chunk(model: ModelSpec, plan: ParallelPlan, pre: bool, post: bool, built: int | tuple[bool, ...]
                ) -> ChunkTrace:
    """Trace one chunk role on the smallest world that has it: TP ranks x 1-3 pipeline stages.
    ``built`` is the number of layers to build, or, for a model that mixes MoE and dense layers,
    the kinds of the layers to build (True: MoE).

    The chunk's ops depend on TP (and the expert TP and EP of MoE layers), not on DP or the number
    of stages, so a world of ``tensor_parallel x (1..3)`` ranks (times the fewest DP ranks that hold
    the expert TP x EP ranks) builds the same shard as the full world, in a fraction of the time
    megatron needs to create every process group of thousands of ranks.

    With context parallelism the chunk is built for the whole sequence (learned position tables
    keep all their rows) and run on one CP rank's tokens, ``seq_length / context_parallel``:
    megatron-core's CP attention runs only through TransformerEngine, so the layer is traced
    without CP on the local sequence, and the CP attention (its exchange of keys and values, and
    the local queries' attention to the other ranks' keys) is derived from it when costing
    (:mod:`vtrain_plugin.cost.comm.context_parallel`). The trace world thus has no CP ranks, and its DP
    ranks alone make up the TP x CP x DP ranks the full world lays its expert ranks over: the MoE
    layers dispatch one CP rank's tokens over the same expert TP and EP groups either way.
    """
    stages = 1 if (pre and post) else 2 if (pre or post) else 3
    # No CP in the trace world (see above): the fewest DP ranks that, with TP, hold the expert TP x EP
    # ranks (the full world's TP x CP x DP does, by the layout rule "(tp*cp*dp) % (ep*etp)").
    expert_ranks = plan.expert_parallel * plan.expert_tp
    trace_plan = ParallelPlan(tensor_parallel=plan.tensor_parallel, pipeline_parallel=stages,
                              data_parallel=expert_ranks // math.gcd(plan.tensor_parallel, expert_ranks),
                              sequence_parallel=plan.sequence_parallel,
                              micro_batch_size=plan.micro_batch_size, recompute=plan.recompute,
                              recompute_modules=plan.recompute_modules,
                              expert_parallel=plan.expert_parallel, expert_tensor_parallel=plan.expert_tensor_parallel,
                              moe_token_dispatcher=plan.moe_token_dispatcher)
    rank = 0 if pre else stages - 1 if post else 1
    role = ChunkRole(pipeline_rank=rank, chunk=0, pre_process=pre, post_process=post)
    local = replace(model, seq_length=plan.local_seq_length(model))  # one CP rank's tokens
    try:
        with quiet_megatron(), cpu_tracing_patches(), fake_world(trace_plan, pipeline_rank=rank) as group_names:
            reset_global_memory_buffer()
            with FakeTensorMode(allow_non_fake_inputs=True):
                kinds = built if isinstance(built, tuple) else None
                gpt = build_chunk(model, trace_plan, role, layers_per_chunk=len(kinds) if kinds else built,
                                  layer_kinds=kinds)
                prepare_for_recording(gpt)
                recorder = OpRecorder(gpt)
                with recorder.recording():
                    run_training_step(gpt, local, trace_plan, role, recorder)
            reset_global_memory_buffer()
            params_by_block, expert_params_by_block, word_embedding = _parameter_counts(gpt)
    except (RuntimeError, TypeError, AssertionError, NotImplementedError) as exc:
        raise TraceError(f"tracing the megatron-core model failed: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc

    def group_of(name: str) -> ParallelGroup:
        try:
            return group_names[name]
        except KeyError:
            raise TraceError(f"a collective ran on process group {name!r}, which is none of "
                             f"tp/dp/pp/embedding") from None

    nodes = [folding.to_node(r, group_of) for r in recorder.records]
    blocks = folding.split_blocks(nodes, recorder.saved_nbytes)
    if (isinstance(built, int) and not model.is_hybrid and not mixes_windows(model)  # else one of each kind
            and not mixes_nope(model)
            and not folding.layers_identical(blocks)):
        log.warning("traced layers differ; they are kept as separate blocks")
    return ChunkTrace(blocks=tuple(blocks), params_by_block=params_by_block,
                      expert_params_by_block=expert_params_by_block,
                      word_embedding_params=word_embedding,
                      activation_shape=stage_input_shape(local, plan),
                      activation_dtype=Dtype(model.dtype).torch_name,
                      held_nbytes=recorder.held_nbytes, backward_peak_nbytes=recorder.backward_peak_nbytes,
                      held_outside_attention_nbytes=recorder.held_outside_attention_nbytes,
                      backward_peak_outside_attention_nbytes=recorder.backward_peak_outside_attention_nbytes,
                      gpu_softmax_backward_peak_nbytes=recorder.gpu_softmax_backward_peak_nbytes)


def _parameter_counts(module: torch.nn.Module
                      ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], int]:
    """Elements of each parameter per block (per layer for layers), in ``named_parameters`` order:
    those megatron-core's DDP reduces over DP, then those it reduces over expert DP; and the
    elements of the word embedding / output weight."""
    numels: dict[str, list[int]] = {}
    expert: dict[str, list[int]] = {}
    word_embedding = 0
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 1)[0]
        _, block = folding.block_of(owner)
        (expert if is_expert_parallel_parameter(p) else numels).setdefault(block, []).append(p.numel())
        if owner in TIED_WEIGHT_OWNERS:
            word_embedding = p.numel()
    return ({block: tuple(sizes) for block, sizes in numels.items()},
            {block: tuple(sizes) for block, sizes in expert.items()}, word_embedding)
