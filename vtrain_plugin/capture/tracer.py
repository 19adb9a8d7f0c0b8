"""``trace()``: capture the operator graph of one training iteration from a real model.

For a megatron-core GPT (given as a :class:`ModelSpec` or a ``TransformerConfig``), every model
chunk of the plan is built through :mod:`megatron_adapters` on a fake process group under
FakeTensorMode (no memory), and one micro-batch of forward, loss, backward and the optimizer step
is recorded. Chunks that play the same role (first, middle, last) share one trace; a chunk is
traced with ``traced_layers`` layers, which must come out identical, and the folded layer stands
for all of the chunk's layers. Traces are cached in-process by their shape key.

A plain ``torch.nn.Module`` with a sample input is traced on the meta device as a single stage.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import torch

from vtrain_plugin.capture import folding
from vtrain_plugin.core.errors import ConfigError, TraceError
from vtrain_plugin.core.graph import Block, BlockKind, OpGraph, ParallelGroup, Phase, StageGraph
from vtrain_plugin.core.dtypes import Dtype
from megatron_adapters.conventions import TIED_WEIGHT_OWNERS
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.capture.recorder import OpRecorder

log = logging.getLogger(__name__)

DEFAULT_TRACED_LAYERS = 2
_CACHE_SIZE = 64


@dataclass(frozen=True, slots=True)
class _ChunkTrace:
    """What one traced chunk role yields; independent of PP, DP and the chunk's layer count."""

    blocks: tuple[Block, ...]  # layers not yet folded
    params_by_block: dict[str, tuple[int, ...]]  # each parameter's elements per block name (per layer)
    word_embedding_params: int  # of the (possibly shared) word embedding / output weight here
    activation_shape: tuple[int, ...]
    activation_dtype: str
    # Folded blocks per chunk layer count, filled by _assemble_stage: every stage of this role (in
    # every plan that shares the trace) gets the same blocks, folded once.
    folded: dict[int, tuple[Block, ...]] = field(default_factory=dict, compare=False)


_cache: OrderedDict[tuple, _ChunkTrace] = OrderedDict()


def clear_cache() -> None:
    _cache.clear()


def trace(model: Any, parallel: ParallelPlan | None = None, *, micro_batch_size: int | None = None,
          seq_length: int | None = None, vocab_size: int | None = None,
          sample_input: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
          traced_layers: int | None = DEFAULT_TRACED_LAYERS) -> OpGraph:
    """Trace one training iteration of ``model`` into an :class:`OpGraph`.

    ``model`` is a :class:`ModelSpec`, a megatron-core ``TransformerConfig`` (then ``vocab_size``
    and ``seq_length`` are required; the GPT family is inferred from its normalization), or a
    built ``torch.nn.Module`` (then ``sample_input`` is required). ``parallel`` defaults to one GPU;
    ``micro_batch_size`` overrides the plan's. ``traced_layers`` is how many layers of each chunk
    are actually built and run (``None``: all of them).
    """
    plan = parallel or ParallelPlan()
    if micro_batch_size is not None:
        plan = replace(plan, micro_batch_size=micro_batch_size)
    if isinstance(model, torch.nn.Module):
        if sample_input is None:
            raise ConfigError("sample_input is required to trace a plain torch.nn.Module")
        return _trace_module(model, sample_input, loss_fn)
    if not isinstance(model, ModelSpec):
        model = _spec_from_transformer_config(model, vocab_size=vocab_size, seq_length=seq_length)
    if traced_layers is not None and traced_layers < 1:
        raise ConfigError(f"traced_layers must be positive or None, got {traced_layers}")
    return trace_gpt(model, plan, traced_layers=traced_layers)


def trace_gpt(model: ModelSpec, plan: ParallelPlan, *, traced_layers: int | None = DEFAULT_TRACED_LAYERS) -> OpGraph:
    plan.check_fits(model)
    layers = plan.chunk_layers(model)
    stages = []
    for chunk in range(plan.virtual_pipeline):
        for rank in range(plan.pipeline_parallel):
            stages.append(_stage(model, plan, rank, chunk, layers[rank][chunk], traced_layers))
    return OpGraph(model=model, parallel=plan, micro_batch_size=plan.micro_batch_size,
                   seq_length=model.seq_length, stages=tuple(stages))


def trace_stage(model: ModelSpec, plan: ParallelPlan, *, pipeline_rank: int, chunk: int = 0,
                traced_layers: int | None = None) -> StageGraph:
    """Trace one model chunk only (by default with every one of its layers built and run)."""
    plan.check_fits(model)
    if not 0 <= pipeline_rank < plan.pipeline_parallel:
        raise ConfigError(f"pipeline_rank must be in [0, {plan.pipeline_parallel}), got {pipeline_rank}")
    return _stage(model, plan, pipeline_rank, chunk, plan.chunk_layers(model)[pipeline_rank][chunk], traced_layers)


def _stage(model: ModelSpec, plan: ParallelPlan, rank: int, chunk: int, num_layers: int,
           traced_layers: int | None) -> StageGraph:
    """One chunk of ``num_layers`` layers, traced with at most ``traced_layers`` of them built (and
    at least one: a chunk that holds only the embedding or the loss, as an uneven split may leave
    one, is traced with a layer and folded to none)."""
    from megatron_adapters.gpt import chunk_role

    built = max(1, num_layers if traced_layers is None else min(num_layers, traced_layers))
    role = chunk_role(plan, rank, chunk)
    traced = _trace_chunk_cached(model, plan, role.pre_process, role.post_process, built)
    return _assemble_stage(traced, rank, chunk, num_layers)


def plan_shape_key(plan: ParallelPlan) -> tuple:
    """What of a plan its chunk traces depend on: plans with different keys share no chunk trace
    (the plan search groups plans by it, so that each shape is traced in one process)."""
    return (plan.tensor_parallel, plan.sequence_parallel, plan.micro_batch_size, plan.recompute.value,
            plan.pipeline_parallel > 1)


def _shape_key(model: ModelSpec, plan: ParallelPlan, pre: bool, post: bool, built: int) -> tuple:
    return (_model_dims(model), *plan_shape_key(plan), pre, post, built)


@lru_cache(maxsize=256)
def _model_dims(model: ModelSpec) -> tuple:
    """Every field of ``model`` a chunk's trace depends on (all but its name and layer count)."""
    dims = {k: v for k, v in model.to_dict().items() if k not in ("num_layers", "name")}
    return tuple(sorted(dims.items()))


def _trace_chunk_cached(model: ModelSpec, plan: ParallelPlan, pre: bool, post: bool, built: int) -> _ChunkTrace:
    key = _shape_key(model, plan, pre, post, built)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    start = time.perf_counter()
    traced = _trace_chunk(model, plan, pre, post, built)
    log.info("traced chunk (pre=%s post=%s, %d layers) in %.2f s", pre, post, built,
             time.perf_counter() - start)
    _cache[key] = traced
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return traced


def _trace_chunk(model: ModelSpec, plan: ParallelPlan, pre: bool, post: bool, built: int) -> _ChunkTrace:
    """Trace one chunk role on the smallest world that has it: TP ranks x 1-3 pipeline stages.

    The chunk's ops depend on TP, not on DP or the number of stages, so a world of
    ``tensor_parallel x (1..3)`` ranks builds the same shard as the full world, in a fraction of
    the time megatron needs to create every process group of thousands of ranks.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_adapters.cpu_patches import cpu_tracing_patches
    from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
    from megatron_adapters.gpt import (ChunkRole, build_chunk, prepare_for_recording, run_training_step,
                                       stage_input_shape)

    stages = 1 if (pre and post) else 2 if (pre or post) else 3
    trace_plan = ParallelPlan(tensor_parallel=plan.tensor_parallel, pipeline_parallel=stages,
                              data_parallel=1, sequence_parallel=plan.sequence_parallel,
                              micro_batch_size=plan.micro_batch_size, recompute=plan.recompute)
    rank = 0 if pre else stages - 1 if post else 1
    role = ChunkRole(pipeline_rank=rank, chunk=0, pre_process=pre, post_process=post)
    try:
        with quiet_megatron(), cpu_tracing_patches(), fake_world(trace_plan, pipeline_rank=rank) as group_names:
            reset_global_memory_buffer()
            with FakeTensorMode(allow_non_fake_inputs=True):
                gpt = build_chunk(model, trace_plan, role, layers_per_chunk=built)
                prepare_for_recording(gpt)
                recorder = OpRecorder(gpt)
                with recorder.recording():
                    run_training_step(gpt, model, trace_plan, role, recorder)
            reset_global_memory_buffer()
            params_by_block, word_embedding = _parameter_counts(gpt)
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
    if not folding.layers_identical(blocks):
        log.warning("traced layers differ; they are kept as separate blocks")
    return _ChunkTrace(blocks=tuple(blocks), params_by_block=params_by_block,
                       word_embedding_params=word_embedding,
                       activation_shape=stage_input_shape(model, plan),
                       activation_dtype=Dtype(model.dtype).torch_name)


def _parameter_counts(module: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], int]:
    """Elements of each parameter per block (per layer for layers), in ``named_parameters`` order,
    and of the word embedding / output weight."""
    numels: dict[str, list[int]] = {}
    word_embedding = 0
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 1)[0]
        _, block = folding.block_of(owner)
        numels.setdefault(block, []).append(p.numel())
        if owner in TIED_WEIGHT_OWNERS:
            word_embedding = p.numel()
    return {block: tuple(sizes) for block, sizes in numels.items()}, word_embedding


def _assemble_stage(traced: _ChunkTrace, rank: int, chunk: int, per_chunk: int) -> StageGraph:
    """One stage's graph from its role's trace: layers folded to the chunk's count, parameters
    per block. Stages of one role share their blocks' node tuples, so each is costed once."""
    blocks = traced.folded.get(per_chunk)
    if blocks is None:
        blocks = traced.folded[per_chunk] = tuple(
            replace(block, num_parameters=sum(traced.params_by_block.get(block.name, ())),
                    parameter_numels=traced.params_by_block.get(block.name, ()))
            for block in folding.fold_layers(traced.blocks, per_chunk))
    return StageGraph(pipeline_rank=rank, chunk=chunk, blocks=blocks,
                      activation_shape=traced.activation_shape, activation_dtype=traced.activation_dtype,
                      word_embedding_parameters=traced.word_embedding_params)


def _spec_from_transformer_config(config: Any, *, vocab_size: int | None, seq_length: int | None) -> ModelSpec:
    from megatron_adapters.config_map import model_spec_from_transformer_config

    if vocab_size is None or seq_length is None:
        raise ConfigError("vocab_size and seq_length are required when tracing from a TransformerConfig")
    return model_spec_from_transformer_config(config, vocab_size=vocab_size, seq_length=seq_length)


def _trace_module(module: torch.nn.Module, sample_input: Any, loss_fn: Callable | None) -> OpGraph:
    """Trace a plain module on the meta device: forward, loss, backward, Adam step, one stage."""
    meta = copy.deepcopy(module).to("meta")
    inputs = _to_meta(sample_input if isinstance(sample_input, (tuple, list)) else (sample_input,))
    recorder = OpRecorder(meta)
    params = [p for p in meta.parameters() if p.requires_grad]
    with recorder.recording():
        with recorder.phase(Phase.FORWARD):
            output = meta(*inputs)
            with recorder.module("loss"):
                loss = loss_fn(output) if loss_fn is not None else output.float().mean()
        with recorder.phase(Phase.BACKWARD):
            loss.backward()
        with recorder.paused():
            optimizer = torch.optim.Adam(params, foreach=False)
        with recorder.phase(Phase.OPTIMIZER), recorder.module("optimizer"):
            optimizer.step()
    nodes = [folding.to_node(r, lambda name: ParallelGroup.DP) for r in recorder.records]
    block = Block(kind=BlockKind.STAGE, name="model", nodes=tuple(nodes),
                  num_parameters=sum(p.numel() for p in params), parameter_numels=tuple(p.numel() for p in params))
    stage = StageGraph(pipeline_rank=0, blocks=(block,))
    first = inputs[0] if inputs else None
    batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
    return OpGraph(model=None, module_name=type(module).__name__, parallel=ParallelPlan(),
                   micro_batch_size=int(batch), seq_length=0, stages=(stage,))


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return tuple(_to_meta(v) for v in value)
    return value
