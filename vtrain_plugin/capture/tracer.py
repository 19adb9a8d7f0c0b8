"""``trace()``: capture the operator graph of one training iteration from a real model.

For a megatron-core GPT (given as a :class:`ModelSpec` or a ``TransformerConfig``), every model
chunk of the plan is built through :mod:`megatron_adapters` on a fake process group under
FakeTensorMode (no memory), and one micro-batch of forward, loss, backward and the optimizer step
is recorded. Chunks that play the same role (first, middle, last) share one trace; a chunk is
traced with ``traced_layers`` layers, which must come out identical, and the folded layer stands
for all of the chunk's layers. Chunk traces are cached by their shape key
(:func:`~vtrain_plugin.capture.chunk.shape_key`) in this process and on disk
(:mod:`~vtrain_plugin.capture.disk_cache`); torch and megatron-core are imported only when a chunk
is in neither, so re-estimating a plan traced before loads neither.

A plain ``torch.nn.Module`` with a sample input is traced on the meta device as a single stage.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from megatron_adapters.conventions import chunk_role
from vtrain_plugin.capture import disk_cache, folding
from vtrain_plugin.capture.chunk import ChunkTrace, shape_key
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import OpGraph, StageGraph
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_TRACED_LAYERS = 2
_CACHE_SIZE = 64

_cache: OrderedDict[tuple, ChunkTrace] = OrderedDict()


def clear_cache() -> None:
    """Forget the traces of this process (the on-disk cache is :mod:`~vtrain_plugin.capture.disk_cache`'s)."""
    _cache.clear()


def trace(model: Any, parallel: ParallelPlan | None = None, *, micro_batch_size: int | None = None,
          seq_length: int | None = None, vocab_size: int | None = None,
          sample_input: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
          traced_layers: int | None = DEFAULT_TRACED_LAYERS) -> OpGraph:
    """Trace one training iteration of ``model`` into an :class:`OpGraph`.

    ``model`` is a :class:`ModelSpec`, a megatron-core ``TransformerConfig`` (then ``vocab_size``
    and ``seq_length`` are required; the GPT or Llama layer is read from its fields, its TP / PP /
    virtual pipeline / SP / recompute are the plan when ``parallel`` is None and must agree with
    ``parallel`` otherwise, and fields vtrain does not model yet are refused), or a
    built ``torch.nn.Module`` (then ``sample_input`` is required: its first dimension is the
    micro-batch size; ``seq_length`` is the tokens per sample, read from the input when it is a
    2-D integer tensor of token ids, else unknown and tokens/s is not reported). ``parallel`` defaults to one GPU;
    ``micro_batch_size`` overrides the plan's. ``traced_layers`` is how many layers of each chunk
    are actually built and run (``None``: all of them).
    """
    if not isinstance(model, ModelSpec):
        import torch  # here, not at module level: a ModelSpec traced before needs no torch at all

        if isinstance(model, torch.nn.Module):
            if sample_input is None:
                raise ConfigError("sample_input is required to trace a plain torch.nn.Module")
            from vtrain_plugin.capture.module_trace import trace_module

            return trace_module(model, sample_input, loss_fn, seq_length=seq_length)
        model, parallel = _from_transformer_config(model, parallel, vocab_size=vocab_size, seq_length=seq_length)
    plan = parallel or ParallelPlan()
    if micro_batch_size is not None:
        plan = replace(plan, micro_batch_size=micro_batch_size)
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
    built = max(1, num_layers if traced_layers is None else min(num_layers, traced_layers))
    role = chunk_role(plan, rank, chunk)
    traced = _trace_chunk_cached(model, plan, role.pre_process, role.post_process, built)
    return _assemble_stage(traced, rank, chunk, num_layers)


def _trace_chunk_cached(model: ModelSpec, plan: ParallelPlan, pre: bool, post: bool, built: int) -> ChunkTrace:
    """The chunk's trace from this process's cache, else the disk cache, else traced (and stored in both)."""
    key = shape_key(model, plan, pre, post, built)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    traced = disk_cache.load(key)
    if traced is not None:
        log.info("read chunk (pre=%s post=%s, %d layers) from the trace cache", pre, post, built)
    else:
        # torch and megatron-core are loaded here, when a chunk must really be traced, and only then.
        from vtrain_plugin.capture.megatron_chunk import trace_chunk

        start = time.perf_counter()
        traced = trace_chunk(model, plan, pre, post, built)
        log.info("traced chunk (pre=%s post=%s, %d layers) in %.2f s", pre, post, built,
                 time.perf_counter() - start)
        disk_cache.store(key, traced)
    _cache[key] = traced
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return traced


def _assemble_stage(traced: ChunkTrace, rank: int, chunk: int, per_chunk: int) -> StageGraph:
    """One stage's graph from its role's trace: layers folded to the chunk's count, parameters
    per block. Stages of one role share their blocks' node tuples, so each is costed once."""
    blocks = traced.folded.get(per_chunk)
    if blocks is None:
        blocks = traced.folded[per_chunk] = tuple(
            replace(block, num_parameters=sum(traced.params_by_block.get(block.name, ()))
                    + sum(traced.expert_params_by_block.get(block.name, ())),
                    parameter_numels=traced.params_by_block.get(block.name, ()),
                    expert_parameter_numels=traced.expert_params_by_block.get(block.name, ()))
            for block in folding.fold_layers(traced.blocks, per_chunk))
    return StageGraph(pipeline_rank=rank, chunk=chunk, blocks=blocks,
                      activation_shape=traced.activation_shape, activation_dtype=traced.activation_dtype,
                      word_embedding_parameters=traced.word_embedding_params)


def _from_transformer_config(config: Any, parallel: ParallelPlan | None, *, vocab_size: int | None,
                             seq_length: int | None) -> tuple[ModelSpec, ParallelPlan]:
    """The model and plan of a TransformerConfig: its fields honoured, or refused when not modelled."""
    from megatron_adapters.config_map import model_spec_from_transformer_config, parallel_plan_from_transformer_config

    if vocab_size is None or seq_length is None:
        raise ConfigError("vocab_size and seq_length are required when tracing from a TransformerConfig")
    model = model_spec_from_transformer_config(config, vocab_size=vocab_size, seq_length=seq_length)
    return model, parallel_plan_from_transformer_config(config, parallel)
