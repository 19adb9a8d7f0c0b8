"""``trace()``: capture the operator graph of one training iteration from a real model.

For a megatron-core GPT (given as a :class:`ModelSpec` or a ``TransformerConfig``), every model
chunk of the plan is built through :mod:`megatron_adapters` on a fake process group under
FakeTensorMode (no memory), and one micro-batch of forward, loss, backward and the optimizer step
is recorded. Chunks that play the same role (first, middle, last) share one trace; a chunk is
traced with ``traced_layers`` layers, which must come out identical, and the folded layer stands
for all of the chunk's layers. Chunk traces are cached by their shape key
(:func:`~vtrain_plugin.capture.chunk.shape_key`) in this process and on disk
(:mod:`~vtrain_plugin.capture.disk_cache`); torch and megatron-core are imported only when a chunk
is in neither, so re-estimating a plan traced before loads neither. While this process's
``torch.distributed`` is initialised (a training script), chunks are traced in a child process
(:mod:`~vtrain_plugin.capture.child_trace`), leaving the script's process groups alone.

A built megatron-core ``GPTModel`` (``MambaModel``) is traced as the ModelSpec it was built from
(:mod:`megatron_adapters.gpt_model`, :mod:`megatron_adapters.hybrid`). Any other ``torch.nn.Module`` with a sample input is traced on
the meta device as a single stage.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from megatron_adapters.conventions import chunk_role
from vtrain_plugin.capture import disk_cache, folding
from vtrain_plugin.capture.chunk import ChunkTrace, shape_key
from vtrain_plugin.capture.rescale import PROBES, rescale
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import OpGraph, StageGraph
from vtrain_plugin.specs.hybrid import stage_patterns, traced_kinds
from vtrain_plugin.specs.attention import mixes_nope, mixes_windows, nope_layers, windowed_layers
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

if TYPE_CHECKING:
    import torch

    from vtrain_plugin.capture.child_trace import Role

log = logging.getLogger(__name__)

DEFAULT_TRACED_LAYERS = 2
# Chunk traces this process keeps: a search's batches revisit them (every role of a shape: PP 105's
# 24 MT-NLG shapes are 72 entries) and prepare's lowering caches are keyed by their node tuples, so
# an evicted and re-read trace is lowered again. An MT-NLG 530B role is 0.10-0.15 MB in memory
# (tracemalloc over disk_cache.load), so 512 entries stay under ~80 MB.
_CACHE_SIZE = 512

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
    ``parallel`` otherwise, and fields vtrain does not model yet are refused), a built megatron-core
    ``GPTModel`` (or a training script's wrapped list of them: read as its config, vocabulary,
    position embedding and embedding tying, see :mod:`megatron_adapters.gpt_model`; the micro-batch
    and tokens per sample are ``sample_input``'s, its input_ids, else ``micro_batch_size`` and
    ``seq_length``), or any other built ``torch.nn.Module`` (then ``sample_input`` is required: its
    first dimension is the micro-batch size; ``seq_length`` is the tokens per sample, read from the
    input when it is a 2-D integer tensor of token ids, else unknown and tokens/s is not reported).
    ``parallel`` defaults to one GPU; ``micro_batch_size`` overrides the plan's. ``traced_layers`` is
    how many layers of each chunk are actually built and run (``None``: all of them).
    """
    if not isinstance(model, ModelSpec):
        import torch  # here, not at module level: a ModelSpec traced before needs no torch at all

        from megatron_adapters.gpt_model import find_gpt_model

        from megatron_adapters.hybrid import find_mamba_model

        gpt = find_gpt_model(model)
        mamba = None if gpt is not None else find_mamba_model(model)
        if mamba is not None:  # a Mamba hybrid: megatron_adapters/hybrid.py
            model, parallel = _from_gpt_model(mamba, parallel, sample_input=sample_input, seq_length=seq_length,
                                              micro_batch_size=micro_batch_size)
        elif gpt is not None:
            model, parallel = _from_gpt_model(gpt, parallel, sample_input=sample_input, seq_length=seq_length,
                                              micro_batch_size=micro_batch_size)
        elif isinstance(model, torch.nn.Module):
            if sample_input is None:
                raise ConfigError("sample_input is required to trace a plain torch.nn.Module")
            from vtrain_plugin.capture.module_trace import trace_module

            return trace_module(model, sample_input, loss_fn, seq_length=seq_length)
        else:
            model, parallel = _from_transformer_config(model, parallel, vocab_size=vocab_size, seq_length=seq_length)
    plan = parallel or ParallelPlan()
    if micro_batch_size is not None:
        plan = replace(plan, micro_batch_size=micro_batch_size)
    if traced_layers is not None and traced_layers < 1:
        raise ConfigError(f"traced_layers must be positive or None, got {traced_layers}")
    return trace_gpt(model, plan, traced_layers=traced_layers)


def trace_gpt(model: ModelSpec, plan: ParallelPlan, *, traced_layers: int | None = DEFAULT_TRACED_LAYERS) -> OpGraph:
    plan.check_fits(model)
    return OpGraph(model=model, parallel=plan, micro_batch_size=plan.micro_batch_size,
                   seq_length=model.seq_length, stages=_stages(model, plan, _plan_chunks(model, plan), traced_layers))


def trace_stage(model: ModelSpec, plan: ParallelPlan, *, pipeline_rank: int, chunk: int = 0,
                traced_layers: int | None = None) -> StageGraph:
    """Trace one model chunk only (by default with every one of its layers built and run)."""
    plan.check_fits(model)
    if not 0 <= pipeline_rank < plan.pipeline_parallel:
        raise ConfigError(f"pipeline_rank must be in [0, {plan.pipeline_parallel}), got {pipeline_rank}")
    num_layers = plan.chunk_layers(model)[pipeline_rank][chunk]
    (stage,) = _stages(model, plan, [(pipeline_rank, chunk, num_layers)], traced_layers)
    return stage


def _stages(model: ModelSpec, plan: ParallelPlan, chunks: list[tuple[int, int, int]],
            traced_layers: int | None) -> tuple[StageGraph, ...]:
    """The stages of ``chunks`` (pipeline rank, chunk, layers); chunks of one role share a trace
    (:func:`_roles`), and those that also share their layer count (and kinds) share every field but
    their place, assembled once."""
    roles = _roles(model, plan, chunks, traced_layers)
    kinds_of = _chunk_layer_kinds(model, plan) if model.has_dense_layers_between_moe else {}
    traces = _chunk_traces(model, plan, roles)
    if model.is_hybrid:
        patterns = stage_patterns(plan, model)
        return tuple(_assemble_hybrid_stage(traces[role], model, rank, patterns[rank])
                     for role, (rank, _, _) in zip(roles, chunks, strict=True))
    first = first_layer_numbers(model, plan) if mixes_windows(model) or mixes_nope(model) else None
    counted = nope_layers if mixes_nope(model) else windowed_layers
    assembled: dict[tuple, dict[str, Any]] = {}
    stages = []
    for role, (rank, chunk, num_layers) in zip(roles, chunks, strict=True):
        kinds = kinds_of.get((rank, chunk))
        two_kinds = None if first is None else (counted is nope_layers, counted(model, first[rank][chunk], num_layers))
        alike = (role, num_layers, kinds, two_kinds)
        fields = assembled.get(alike)
        if fields is None:
            fields = assembled[alike] = _stage_fields(traces[role], num_layers, kinds, two_kinds=two_kinds)
        stages.append(StageGraph(pipeline_rank=rank, chunk=chunk, **fields))
    return tuple(stages)


def _plan_chunks(model: ModelSpec, plan: ParallelPlan) -> list[tuple[int, int, int]]:
    """(pipeline rank, chunk, layers) of every chunk of ``plan``, chunk by chunk, rank by rank."""
    layers = plan.chunk_layers(model)
    return [(rank, chunk, layers[rank][chunk]) for chunk in range(plan.virtual_pipeline)
            for rank in range(plan.pipeline_parallel)]


def _roles(model: ModelSpec, plan: ParallelPlan, chunks: list[tuple[int, int, int]],
           traced_layers: int | None) -> list[Role]:
    """The role traced for each of ``chunks``: a chunk of ``num_layers`` layers is traced with at most
    ``traced_layers`` of them built (and at least one: a chunk that holds only the embedding or the
    loss, as an uneven split may leave one, is traced with a layer and folded to none)."""
    roles = []
    kinds_of = _chunk_layer_kinds(model, plan) if model.has_dense_layers_between_moe else {}
    # Windowed and full-attention layers (NoPE and RoPE layers) alternate: at least one of each is
    # traced (two consecutive layers), and each stage counts its own of each kind from its layer numbers.
    fewest = 2 if mixes_windows(model) or mixes_nope(model) else 1
    hybrid = model.is_hybrid
    last_rank, last_chunk = plan.pipeline_parallel - 1, plan.virtual_pipeline - 1
    # A chunk's role depends on whether it is a first or last one, its layers and their kinds: the
    # middle chunks of a plan share one.
    found: dict[tuple, Role] = {}
    for rank, chunk, num_layers in chunks:
        kinds = kinds_of.get((rank, chunk))
        alike = (rank if rank in (0, last_rank) else -1, chunk if chunk in (0, last_chunk) else -1, num_layers, kinds)
        known = found.get(alike)
        if known is None:
            role = chunk_role(plan, rank, chunk)
            built: int | tuple[bool, ...] = max(fewest, num_layers if traced_layers is None
                                                else min(num_layers, traced_layers))
            if kinds_of:
                built = _built_kinds(kinds, built, traced_layers is None)
            if hybrid:  # one layer of each kind, whatever the stage (megatron_adapters/hybrid.py)
                built = len(traced_kinds(model.hybrid_layer_pattern or ""))
            known = found[alike] = (role.pre_process, role.post_process, built)
        roles.append(known)
    return roles


def _chunk_layer_kinds(model: ModelSpec, plan: ParallelPlan) -> dict[tuple[int, int], tuple[bool, ...]]:
    """Whether each layer of each (pipeline rank, chunk) is a MoE layer: the model's layers laid
    out in megatron-core's order of virtual stages (chunk 0 of every rank, then chunk 1, ...)."""
    layers = plan.chunk_layers(model)
    pattern = model.moe_layer_pattern
    kinds, start = {}, 0
    for chunk in range(plan.virtual_pipeline):
        for rank in range(plan.pipeline_parallel):
            count = layers[rank][chunk]
            kinds[rank, chunk] = pattern[start:start + count]
            start += count
    return kinds


def _built_kinds(kinds: tuple[bool, ...], built: int, every_layer: bool) -> tuple[bool, ...]:
    """The layers traced for a chunk of layers ``kinds``: all of them with ``every_layer``; one of
    each kind when it holds both (each kind's template then counts as many times as the chunk holds
    it); else ``built`` layers of its one kind (a chunk of none: one MoE layer, folded to none)."""
    if every_layer:
        return kinds or (True,)
    present = tuple(dict.fromkeys(sorted(kinds)))
    return present if len(present) > 1 else (present[0] if present else True,) * built


def first_layer_numbers(model: ModelSpec, plan: ParallelPlan) -> tuple[tuple[int, ...], ...]:
    """The number (1-based, over the whole model) of the first layer of each ``[pipeline_rank][chunk]``:
    megatron-core numbers layers in the order of the virtual stages, chunk by chunk, rank by rank."""
    layers = plan.chunk_layers(model)
    first = [[0] * plan.virtual_pipeline for _ in range(plan.pipeline_parallel)]
    number = 1
    for chunk in range(plan.virtual_pipeline):
        for rank in range(plan.pipeline_parallel):
            first[rank][chunk] = number
            number += layers[rank][chunk]
    return tuple(tuple(row) for row in first)


def _chunk_traces(model: ModelSpec, plan: ParallelPlan, roles: list[Role]) -> dict[Role, ChunkTrace]:
    """Each role's trace from this process's cache, else the disk cache, else traced (and stored in
    both); the roles in neither are traced together (in a child process when this one's
    torch.distributed is in use: :mod:`~vtrain_plugin.capture.child_trace`)."""
    found: dict[Role, ChunkTrace] = {}
    missing = []
    for role in dict.fromkeys(roles):
        key = shape_key(model, plan, *role)
        traced = _cache.get(key)
        if traced is not None:
            _cache.move_to_end(key)
        elif (traced := disk_cache.load(key)) is not None:
            log.info("read chunk (pre=%s post=%s, %d layers) from the trace cache", *role)
            _remember(key, traced)
        else:
            missing.append(role)
            continue
        found[role] = traced
    if missing:
        # here, on a miss only: tracing's process machinery (subprocess, tempfile) is no part of a warm read
        from vtrain_plugin.capture import child_trace

        start = time.perf_counter()
        for role, traced in zip(missing, child_trace.trace_chunks(model, plan, missing), strict=True):
            key = shape_key(model, plan, *role)
            disk_cache.store(key, traced)
            _remember(key, traced)
            found[role] = traced
        log.info("traced %d chunk role(s) in %.2f s", len(missing), time.perf_counter() - start)
    return found


def prepare_traces(model: ModelSpec, plans: Iterable[ParallelPlan], *,
                   traced_layers: int | None = DEFAULT_TRACED_LAYERS) -> None:
    """Put the chunk traces of every plan of ``plans`` in the trace cache, one :class:`TraceJob`
    after another (:func:`trace_jobs`; a search runs the jobs in its worker processes before it
    fans out, so the workers that estimate only read)."""
    jobs = trace_jobs(model, plans, traced_layers=traced_layers)
    for job in jobs:
        run_trace_job(job)
    log.info("chunk roles of %d shapes in the trace cache, %d of them derived from two micro-batch sizes",
             len(jobs), sum(job.derives for job in jobs))


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceJob:
    """One chunk role that the caches lack, at the micro-batch sizes wanted: plain data, so a worker
    process runs it (:func:`run_trace_job`). Jobs write distinct cache entries, so they run in any
    order, in any process."""

    model: ModelSpec
    role: Role
    plans: tuple[ParallelPlan, ...]  # one per size wanted, ascending micro-batch size

    @property
    def derives(self) -> bool:
        """Whether the role is traced at the sizes of :data:`~vtrain_plugin.capture.rescale.PROBES` and
        derived at the others: where that traces fewer sizes (three or more from 2 up; size 1 is
        always traced)."""
        return sum(plan.micro_batch_size >= PROBES[0] for plan in self.plans) >= 3


def trace_jobs(model: ModelSpec, plans: Iterable[ParallelPlan], *,
               traced_layers: int | None = DEFAULT_TRACED_LAYERS) -> list[TraceJob]:
    """The chunk roles of ``plans`` that neither cache holds, one job per role and every size of it
    wanted (the order of first appearance)."""
    wanted: dict[tuple, dict[int, tuple[ParallelPlan, Role]]] = {}
    checked: set[tuple] = set()  # a search's plans share few shape keys: each is looked up once
    for plan in dict.fromkeys(plans):  # plans that differ in training options alone are one plan here
        for role in dict.fromkeys(_roles(model, plan, _plan_chunks(model, plan), traced_layers)):
            key = shape_key(model, plan, *role)
            if key in checked:
                continue
            checked.add(key)
            if key not in _cache and not disk_cache.contains(key):
                group = shape_key(model, replace(plan, micro_batch_size=1), *role)
                wanted.setdefault(group, {})[plan.micro_batch_size] = (plan, role)
    return [TraceJob(model=model, role=next(iter(sizes.values()))[1],
                     plans=tuple(plan for _, (plan, _) in sorted(sizes.items()))) for sizes in wanted.values()]


def run_trace_job(job: TraceJob) -> int:
    """Trace (or derive, :attr:`TraceJob.derives`) ``job``'s role at each of its sizes into both
    caches; the number of micro-batch sizes it covered."""
    model, role = job.model, job.role
    derived: dict[int, ChunkTrace] = {}
    if job.derives:
        low, high = (_chunk_traces(model, replace(job.plans[0], micro_batch_size=b), [role])[role] for b in PROBES)
        derived = {plan.micro_batch_size: chunk for plan in job.plans if plan.micro_batch_size not in PROBES
                   and (chunk := rescale(low, high, plan.micro_batch_size)) is not None}
    for plan in job.plans:
        key = shape_key(model, plan, *role)
        if plan.micro_batch_size in derived:
            disk_cache.store(key, derived[plan.micro_batch_size])
            _remember(key, derived[plan.micro_batch_size])
        elif key not in _cache and not disk_cache.contains(key):
            _chunk_traces(model, plan, [role])
    return len(job.plans)


def _remember(key: tuple, traced: ChunkTrace) -> None:
    _cache[key] = traced
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)


def _stage_fields(traced: ChunkTrace, per_chunk: int, kinds: tuple[bool, ...] | None = None, *,
                  two_kinds: tuple[bool, int] | None = None) -> dict[str, Any]:
    """The fields of a stage but its place, from its role's trace: layers folded to the chunk's count
    (to the count of each kind, MoE and dense, with ``kinds``; with ``two_kinds`` (NoPE, count), that
    many of them NoPE layers, or with a sliding window, when the model alternates them), parameters
    per block. Stages of one role share their blocks' node tuples, so each is costed once."""
    key: int | tuple = per_chunk if kinds is None else kinds
    if two_kinds is not None:
        key = (per_chunk, *two_kinds)
    blocks = traced.folded.get(key)
    if blocks is None:
        if kinds is not None:
            folded = folding.fold_layer_kinds(traced.blocks, kinds)
        elif two_kinds is not None:
            fold = folding.fold_nope_kinds if two_kinds[0] else folding.fold_window_kinds
            folded = fold(traced.blocks, per_chunk, two_kinds[1])
        else:
            folded = folding.fold_layers(traced.blocks, per_chunk)
        blocks = traced.folded[key] = tuple(_with_parameters(traced, block) for block in folded)
    return {"blocks": blocks, "activation_shape": traced.activation_shape, "activation_dtype": traced.activation_dtype,
            "word_embedding_parameters": traced.word_embedding_params, **_held(traced)}


def _assemble_hybrid_stage(traced: ChunkTrace, model: ModelSpec, rank: int, pattern: str) -> StageGraph:
    """A hybrid stage: each traced layer kind counted as often as ``pattern`` (the rank's slice of
    the model's pattern) has it (:func:`~vtrain_plugin.capture.folding.fold_hybrid_layers`)."""
    blocks = traced.folded.get(pattern)
    if blocks is None:
        kinds = traced_kinds(model.hybrid_layer_pattern or "")
        blocks = traced.folded[pattern] = tuple(
            _with_parameters(traced, block) for block in folding.fold_hybrid_layers(traced.blocks, kinds, pattern))
    return StageGraph(pipeline_rank=rank, chunk=0, blocks=blocks,
                      activation_shape=traced.activation_shape, activation_dtype=traced.activation_dtype,
                      word_embedding_parameters=traced.word_embedding_params, **_held(traced))


def _held(traced: ChunkTrace) -> dict[str, int]:
    """The StageGraph fields of what the traced step held beside its activations."""
    return {"held_nbytes": traced.held_nbytes, "backward_peak_nbytes": traced.backward_peak_nbytes,
            "held_outside_attention_nbytes": traced.held_outside_attention_nbytes,
            "backward_peak_outside_attention_nbytes": traced.backward_peak_outside_attention_nbytes,
            "gpu_softmax_backward_peak_nbytes": traced.gpu_softmax_backward_peak_nbytes}


def _with_parameters(traced: ChunkTrace, block):
    return replace(block, num_parameters=sum(traced.params_by_block.get(block.name, ()))
                   + sum(traced.expert_params_by_block.get(block.name, ())),
                   parameter_numels=traced.params_by_block.get(block.name, ()),
                   expert_parameter_numels=traced.expert_params_by_block.get(block.name, ()))


def _from_transformer_config(config: Any, parallel: ParallelPlan | None, *, vocab_size: int | None,
                             seq_length: int | None) -> tuple[ModelSpec, ParallelPlan]:
    """The model and plan of a TransformerConfig: its fields honoured, or refused when not modelled."""
    from megatron_adapters.config_map import (is_transformer_config, model_spec_from_transformer_config,
                                              parallel_plan_from_transformer_config)

    if not is_transformer_config(config):
        raise ConfigError(f"model must be a ModelSpec, a megatron-core TransformerConfig or GPTModel, or a "
                          f"torch.nn.Module; got {type(config).__name__}")
    if vocab_size is None or seq_length is None:
        raise ConfigError("vocab_size and seq_length are required when tracing from a TransformerConfig")
    model = model_spec_from_transformer_config(config, vocab_size=vocab_size, seq_length=seq_length)
    return model, parallel_plan_from_transformer_config(config, parallel)


def _from_gpt_model(gpt: Any, parallel: ParallelPlan | None, *, sample_input: Any, seq_length: int | None,
                    micro_batch_size: int | None) -> tuple[ModelSpec, ParallelPlan]:
    """The model and plan of a built GPTModel: as its TransformerConfig's, with the micro-batch and
    the tokens per sample of ``sample_input`` (one micro-batch of input_ids) or of the arguments."""
    from megatron_adapters.config_map import parallel_plan_from_transformer_config
    from megatron_adapters.gpt_model import model_spec_of_gpt_model
    from vtrain_plugin.capture.sample_input import sample_shape

    shape = None if sample_input is None else sample_shape(sample_input)
    if shape is not None and shape.seq_length is None:
        raise ConfigError("sample_input of a megatron-core GPTModel must be its input_ids (or a tuple that "
                          "starts with them): a 2-D integer tensor [micro_batch, seq_length]")
    seq_length = _agreed("seq_length", seq_length, shape and shape.seq_length)
    micro_batch_size = _agreed("micro_batch_size", micro_batch_size, shape and shape.micro_batch_size)
    if seq_length is None:
        raise ConfigError("tracing a megatron-core GPTModel needs sample_input= (one micro-batch of input_ids) "
                          "or seq_length=")
    plan = parallel_plan_from_transformer_config(gpt.config, parallel)
    if shape is not None and plan.micro_batch_size != 1:  # 1: the plan's default, not a choice
        _agreed("parallel.micro_batch_size", plan.micro_batch_size, shape.micro_batch_size)
    if micro_batch_size is not None:
        plan = replace(plan, micro_batch_size=micro_batch_size)
    from megatron_adapters.hybrid import find_mamba_model, model_spec_of_mamba_model

    if find_mamba_model(gpt) is not None:
        return model_spec_of_mamba_model(gpt, seq_length=seq_length), plan
    return model_spec_of_gpt_model(gpt, seq_length=seq_length), plan


def _agreed(name: str, given: int | None, sampled: int | None) -> int | None:
    if given is not None and sampled is not None and given != sampled:
        raise ConfigError(f"{name} ({given}) != the sample input's ({sampled})")
    return given if given is not None else sampled
