"""Memory each GPU needs: model states from the traced parameters, activations from the trace and
the schedule, and an allowance for what the process holds besides tensors.

Per pipeline rank (the representative one; TP, CP and DP replicas hold the same), for the ``P``
parameters of its chunks:

- weights in the model dtype and gradients in the run's gradient dtype
  (:meth:`vtrain_plugin.specs.training.TrainingSpec.grad_dtype`: fp32 for bf16 as Megatron-LM's
  default, bf16 with ``grad_reduce_in_bf16``), ``P x (2 + 4)`` bytes in bf16 by default. Megatron's
  DDP keeps both whole in its contiguous buffers (the weights are views of the buffer the
  distributed optimizer all-gathers into: no copy besides); TransformerEngine's FP8 weights are
  :mod:`vtrain_plugin.cost.stack_memory`'s;
- optimizer state: fp32 main weights (when the model dtype is narrower) and Adam's two fp32
  moments, ``P x 12`` bytes in fp16/bf16 (another optimizer or state dtype: the bytes of
  :meth:`~vtrain_plugin.specs.optimizer.OptimizerSpec.state_nbytes`; Muon's 2-D layer weights keep
  one fp32 momentum instead of two moments), divided by DP with the distributed optimizer (ZeRO-1
  shards exactly these over Megatron-Core's data-parallel group, DP x CP ranks with context
  parallelism; weights and gradients stay whole). With Megatron-LM's
  ``theoretical_memory_usage`` that is 18 bytes per parameter, or ``6 + 12 / DP``; the parameters
  of experts split by expert parallelism are sharded over the expert DP group instead
  (:func:`~vtrain_plugin.cost.comm.optimizer_shard.optimizer_shards`). Muon under the distributed
  optimizer is megatron-core's layer-wise one instead: each rank holds the whole state of the
  parameters dealt to it (:func:`layer_wise_optimizer_nbytes`, the busiest rank's);
- with FSDP (:mod:`vtrain_plugin.cost.comm.fsdp`) each of weights, gradients and optimizer state is
  divided by the group its strategy shards it over (DP x CP; expert DP for the experts split by
  expert parallelism), and the units gathered or not yet reduce-scattered are added back whole: the
  gathered weights of the most consecutive units held at once, counted with the weights, and their
  unsharded gradients, counted with the gradients (Megatron-FSDP's own buffers: the model-weight
  buffer in the model dtype, the main-grad buffer in the gradient dtype, the fp32 main-weight buffer
  and Adam's moments, ``ParamAndGradBuffer._init_each_parameter_group_buffers``). Without the fixed
  double buffer the unsharded gradients are allocated as a micro-batch's backward runs, which frees
  its stash as they grow, so they count only by what they exceed the smallest chunk's stash and step
  transient (the activation peak comes before them, at the start of that backward);
- activations: what the forward of one micro-batch keeps for backward on each chunk (the saved
  tensors of the real model, captured while tracing), at the schedule's peak of micro-batches in
  flight: the most activation bytes the rank holds at once when walking its task order (1F1B:
  ``min(pp - rank, m)`` micro-batches; interleaved: Megatron's ``pp + (pp - 1) / vp`` micro-batches
  on the first rank, per chunk as the chunks' sizes differ); with ``backward_peaks``, each
  backward in that walk adds, at its start, what the traced step held beside the stash and what its
  backward added at its peak (:attr:`~vtrain_plugin.core.graph.StageGraph.held_nbytes`, ``backward_peak_nbytes``:
  megatron-core's global buffer of attention scores, one recomputed layer's activations under full
  recompute, the gradients in flight, the logits' gradient on the last stage), as ``max allocated``
  sees them; with ``fused_attention``, the same without what the local core attention allocates
  (``held_outside_attention_nbytes``, ``backward_peak_outside_attention_nbytes``: no score buffer,
  no score-sized tensors or gradients); with ``gpu_softmax``, the backward's peak with the temporary
  torch's softmax backward allocates on a GPU (``gpu_softmax_backward_peak_nbytes``: the local spec
  as traced runs that softmax; the fused softmax kernels of the other stacks make none); and with
  ``block_extra`` what a stack holds beyond the traced ops in the backward of one block (TE's
  unfused attention's score gradient, the tensors activation offloading reloads), counted at that
  block's moment, when the blocks after it have freed their stash (:func:`backward_rise`); or what
  the stack holds beside the stash in a forward (a fused cross entropy) where that moment is higher:
  the larger of the two;
- the GEMM libraries' cuBLAS workspaces (``workspaces_gib``, set by
  :mod:`vtrain_plugin.cost.stack_memory` from :mod:`vtrain_plugin.cost.workspaces`): allocated
  tensors too, by the GPU and the stack;
- an allowance (:data:`RESERVED_GIB`, :data:`FRAGMENTATION`): the CUDA context and kernel images,
  NCCL's communicator buffers, cuDNN's and other libraries' workspaces and the caching allocator's
  fragmentation.
  These are not modeled, they are a round allowance so that "fits" leaves room for them: about
  0.5 GiB of context, 1 GiB of NCCL buffers for a handful of communicators and 0.5 GiB of
  workspaces and Megatron's scratch buffers, plus 5% of the tensors for fragmentation (PyTorch's
  ``memory_reserved`` over ``memory_allocated`` in steady-state training).

The optimizer step is another moment: the stash and the backward's transients are gone, and with
a bf16 model's gradients narrower than the optimizer's fp32 main gradients (``grad_reduce_in_bf16``)
Megatron's optimizer copies the rank's gradient shard into fp32 main gradients, all live until the
step ends (``_copy_model_grads_to_main_grads``: 4 bytes per parameter, divided as the optimizer
state is); where those copies are more than the activations at the backward's peak they are the
activations counted (the larger moment).

Not counted: without ``backward_peaks``, the transient activations of the layer being recomputed or
back-propagated and the logits freed before the peak (the model-dtype logits while the loss casts
them to fp32, ``2 s b V / t`` bytes, as Megatron-LM's ``theoretical_memory_usage`` leaves them out
too); the optimizer step's temporaries besides those copies (a fused Adam makes none), and the
copies of an fp16 model's fp16 gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from operator import attrgetter

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import Block, OpGraph, StageGraph
from vtrain_plugin.core.units import GIB
from megatron_adapters.conventions import is_expert_module
from vtrain_plugin.cost.comm.fsdp import StateShards, state_shards, working_set_units
from vtrain_plugin.cost.comm.optimizer_shard import optimizer_shards
from vtrain_plugin.cost.lowering.optimizer_step import muon_matrices
from vtrain_plugin.specs.fsdp import FsdpSettings
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.optimizer import STATE_NBYTES, OptimizerKind, OptimizerSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.training import CudaGraphImpl, ScheduleKind, TrainingSpec, grad_dtype

RESERVED_GIB = 2.0  # CUDA context, NCCL buffers, library workspaces (see the module doc)
FRAGMENTATION = 0.05  # of the tensors' bytes: the caching allocator's fragmentation

PeakLive = Callable[[int, Sequence[int], Sequence[int]], tuple[int, int]]
"""``(pipeline_rank, activation bytes of each of its chunks, what each chunk's backward rises above
its starting level) -> (peak bytes held, (chunk, micro-batch) pairs held then)``: the schedule's walk
(``Schedule.peak_live``)."""


def all_held(pipeline_rank: int, chunk_nbytes: Sequence[int], rise_nbytes: Sequence[int]) -> tuple[int, int]:
    """A :data:`PeakLive` without a schedule: one micro-batch of every chunk held at once, and the
    largest rise beside them."""
    return sum(chunk_nbytes) + max(rise_nbytes, default=0), len(chunk_nbytes)


def _tensors_gib(weights: float, gradients: float, optimizer: float, activations: float, workspaces: float) -> float:
    """:attr:`RankMemory.tensors_gib` of these parts, in its order of additions."""
    return weights + gradients + optimizer + activations + workspaces


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    inflight_microbatches: int  # (chunk, micro-batch) pairs held at the peak
    workspaces_gib: float = 0.0  # the GEMM libraries' workspaces (vtrain_plugin.cost.workspaces)
    allowance_gib: float = 0.0  # context, buffers, workspaces, fragmentation (see the module doc)

    @property
    def tensors_gib(self) -> float:
        """What ``max allocated`` counts: model states, activations and the GEMM workspaces."""
        return _tensors_gib(self.weights_gib, self.gradients_gib, self.optimizer_gib, self.activations_gib,
                            self.workspaces_gib)

    @property
    def total_gib(self) -> float:
        return self.tensors_gib + self.allowance_gib

    def to_dict(self) -> dict[str, float]:
        return {"weights": self.weights_gib, "gradients": self.gradients_gib, "optimizer": self.optimizer_gib,
                "activations": self.activations_gib, "workspaces": self.workspaces_gib,
                "allowance": self.allowance_gib, "total": self.total_gib}


def rank_memory(graph: OpGraph, peak_live: PeakLive, *, distributed_optimizer: bool = False,
                gradients: Dtype | None = None, fsdp: FsdpSettings | None = None,
                optimizer: OptimizerSpec | None = None, backward_peaks: bool = False,
                fused_attention: bool = False, gpu_softmax: bool = False,
                block_extra: Callable[[StageGraph], Sequence[int]] | None = None,
                forward_extra: Callable[[StageGraph], int] | None = None,
                ranks: Sequence[int] | None = None) -> tuple[RankMemory, ...]:
    """Memory of each pipeline rank (see the module doc); ``peak_live`` walks the schedule;
    ``backward_peaks``: add the traced step's held bytes and backward peak, those outside the core
    attention with ``fused_attention`` (a stack whose attention allocates no score-sized tensors),
    with ``gpu_softmax`` the backward's peak with the temporaries of torch's softmax backward on a
    GPU (a stack that runs torch's softmax there), plus ``block_extra(stage)[k]`` where given (what
    that stack holds beyond the traced ops in the backward of the stage's block ``k``, once the
    blocks after it freed their stash), or
    ``forward_extra(stage)`` beside the held bytes where that is more (what they hold beside the
    stash in a forward: another moment, so the larger counts); each chunk's rise enters the
    schedule's walk at its own backward (:func:`backward_rise`);
    ``gradients``: the run's gradient dtype (None: Megatron-LM's default for the model dtype);
    ``fsdp``: the run's FSDP (None: DDP, with the distributed optimizer or not);
    ``optimizer``: the run's (None: Adam in fp32); ``ranks``: for each pipeline rank, the rank
    alike to it whose stages alone ``graph`` holds (:func:`alike_ranks`; None: worked out here).
    Ranks alike share their model states and stash, and those that also hold as many bytes at
    their peak share one result."""
    if ranks is None:
        graph, ranks = alike_ranks(graph)
    dtype = graph.dtype
    gradients = gradients or grad_dtype(dtype)
    optimizer = optimizer or OptimizerSpec()
    plan = graph.parallel
    dense_group, expert_group = optimizer_shards(plan, True)
    if fsdp is None:
        shards, expert_shards = optimizer_shards(plan, distributed_optimizer)
        dense_states, expert_states = StateShards(1, 1, shards), StateShards(1, 1, expert_shards)
    else:
        dense_states, expert_states = state_shards(fsdp, dense_group), state_shards(fsdp, expert_group)
    # Muon under the distributed optimizer is megatron-core's layer-wise one: whole parameters per rank
    layer_wise = optimizer.kind is OptimizerKind.MUON and distributed_optimizer and fsdp is None
    per_param = optimizer.state_nbytes(dtype.nbytes, matrix=False)
    per_matrix_element = optimizer.state_nbytes(dtype.nbytes, matrix=True)
    kinds = set(ranks)  # by the rank of each kind whose stages graph holds
    params = dict.fromkeys(kinds, 0)
    experts = dict.fromkeys(kinds, 0)
    held = dict.fromkeys(kinds, (0, 0))  # FSDP: elements of the units gathered, of their gradients
    matrices = {kind: [0, 0] for kind in kinds}  # Muon's 2-D weights: dense, experts
    chunks = {kind: [0] * plan.virtual_pipeline for kind in kinds}
    rises = {kind: [0] * plan.virtual_pipeline for kind in kinds}
    transient = dict.fromkeys(kinds, 0)  # the most any chunk's step rises above its stash
    for stage in graph.stages:
        if backward_peaks:
            held_alone = stage.held_outside_attention_nbytes if fused_attention else stage.held_nbytes
            peak = (stage.backward_peak_outside_attention_nbytes if fused_attention
                    else stage.gpu_softmax_backward_peak_nbytes if gpu_softmax else stage.backward_peak_nbytes)
            step = held_alone + peak
            extras = block_extra(stage) if block_extra is not None else [0] * len(stage.blocks)
            rise = backward_rise(stage.blocks, step, extras)
            if forward_extra is not None:  # a forward's moment, apart from the backward's
                rise = max(rise, held_alone + forward_extra(stage))
            rises[stage.pipeline_rank][stage.chunk] = rise
            transient[stage.pipeline_rank] = max(transient[stage.pipeline_rank], rise)
        params[stage.pipeline_rank] += stage.num_parameters
        experts[stage.pipeline_rank] += stage.num_expert_parameters
        chunks[stage.pipeline_rank][stage.chunk] = stage.activation_nbytes
        if fsdp is not None:
            held[stage.pipeline_rank] = tuple(map(max, held[stage.pipeline_rank], _fsdp_held(stage, fsdp)))
        if optimizer.kind is OptimizerKind.MUON:
            for block in stage.blocks:
                for module, (rows, columns) in muon_matrices(block.nodes):
                    matrices[stage.pipeline_rank][is_expert_module(module)] += block.count * rows * columns
    states: dict[int, tuple[float, float, float]] = {}  # by the rank alike: weights, gradients, optimizer

    def model_states(rank: int) -> tuple[float, float, float]:
        dense, expert = params[rank] - experts[rank], experts[rank]
        dense_matrices, expert_matrices = matrices[rank]

        def sharded(per_element: float, field: str) -> float:
            return (dense * per_element / getattr(dense_states, field)
                    + expert * per_element / getattr(expert_states, field))

        saved = per_param - per_matrix_element  # per element of a Muon matrix, against Adam
        optimizer_nbytes = ((dense * per_param - dense_matrices * saved) / dense_states.optimizer
                            + (expert * per_param - expert_matrices * saved) / expert_states.optimizer)
        if layer_wise:
            optimizer_nbytes = layer_wise_optimizer_nbytes(
                [s for s in graph.stages if s.pipeline_rank == rank], per_param, per_matrix_element, plan)
        held_weights, held_grads = held[rank]
        # allocated as a micro-batch's backward frees its stash (no fixed double buffer), the unsharded
        # gradients add only what they exceed the smallest chunk's stash and step transient by
        dynamic = fsdp is not None and not fsdp.double_buffer
        freed = min(chunks[rank], default=0) + transient[rank] if dynamic else 0
        return ((sharded(dtype.nbytes, "weights") + held_weights * dtype.nbytes) / GIB,
                (sharded(gradients.nbytes, "gradients") + max(0, held_grads * gradients.nbytes - freed)) / GIB,
                optimizer_nbytes / GIB)

    # the optimizer step's moment: with gradients narrower than the optimizer's main gradients (bf16
    # with grad_reduce_in_bf16), Megatron's optimizer copies the rank's gradient shard into fp32 main
    # gradients, all of them live until the step ends, beside the gradient buffer it keeps
    main_grad_nbytes = STATE_NBYTES[optimizer.main_grads]
    copies = fsdp is None and dtype is Dtype.BF16 and gradients.nbytes < main_grad_nbytes

    def step_nbytes(rank: int) -> float:
        if not copies:
            return 0.0
        dense, expert = params[rank] - experts[rank], experts[rank]
        return main_grad_nbytes * (dense / dense_states.optimizer + expert / expert_states.optimizer)

    out = []
    built: dict[tuple[int, int, int], RankMemory] = {}
    for rank in range(plan.pipeline_parallel):
        alike = ranks[rank]
        activations, inflight = peak_live(rank, chunks[alike], rises[alike])
        activations = max(activations, step_nbytes(alike))  # the larger moment: a backward's or the step's
        memory = built.get((alike, activations, inflight))
        if memory is None:
            if alike not in states:
                states[alike] = model_states(alike)
            weights, grads, optimizer_gib = states[alike]
            activations_gib = activations / GIB
            tensors = _tensors_gib(weights, grads, optimizer_gib, activations_gib, 0.0)  # workspaces: the stack's
            memory = built[(alike, activations, inflight)] = RankMemory(
                weights_gib=weights, gradients_gib=grads, optimizer_gib=optimizer_gib, activations_gib=activations_gib,
                inflight_microbatches=inflight, allowance_gib=RESERVED_GIB + FRAGMENTATION * tensors)
        out.append(memory)
    return tuple(out)


# every field of a stage but its pipeline rank and blocks (those by identity: comparing them is a walk)
_STAGE_FIELDS = attrgetter(*(f.name for f in fields(StageGraph) if f.name not in ("pipeline_rank", "blocks")))


def alike_ranks(graph: OpGraph) -> tuple[OpGraph, tuple[int, ...]]:
    """``graph`` with only the stages of the first pipeline rank of each kind, and for every rank
    the rank of its kind kept: ranks whose stages are alike in order (the same blocks tuple, by
    identity, and every other field but the pipeline rank the same) are of one kind.

    Why: the ranks of one chunk role (first, middle, last) share their blocks tuple, so memory is
    worked out once per kind, a handful, not once per rank (up to 105 in a search); the schedule's
    walk alone differs between them."""
    per_rank: list[list[tuple]] = [[] for _ in range(graph.parallel.pipeline_parallel)]
    for stage in graph.stages:
        per_rank[stage.pipeline_rank].append((id(stage.blocks), *_STAGE_FIELDS(stage)))
    first: dict[tuple, int] = {}
    ranks = tuple(first.setdefault(tuple(keys), rank) for rank, keys in enumerate(per_rank))
    if len(first) == len(ranks):
        return graph, ranks
    return replace(graph, stages=tuple(s for s in graph.stages if ranks[s.pipeline_rank] == s.pipeline_rank)), ranks


def backward_rise(blocks: Sequence[Block], step_nbytes: int, extra_nbytes: Sequence[int]) -> int:
    """What a chunk's backward rises above its starting level (its stash in place): the traced
    step's ``step_nbytes`` (held plus the backward's peak, whose moment the trace does not say), and
    at the backward of each block ``k`` (last to first) that plus ``extra_nbytes[k]`` less the stash
    of the blocks after it, freed by then (a layer block's instances all still hold theirs when its
    first one back-propagates)."""
    rise = freed = 0
    for block, extra in zip(reversed(blocks), reversed(extra_nbytes), strict=True):
        rise = max(rise, extra - freed)
        freed += block.count * block.activation_nbytes
    return step_nbytes + rise


def layer_wise_optimizer_nbytes(stages: Sequence[StageGraph], per_param: int, per_matrix_element: int,
                                plan: ParallelPlan) -> int:
    """Optimizer-state bytes of the data-parallel rank that holds most under megatron-core's
    ``LayerWiseDistributedOptimizer`` (Muon with the distributed optimizer), for the parameters of
    ``stages`` (one pipeline rank's chunks): each parameter is held whole by one rank, dealt in
    increasing size, ties in the model's order with Muon's matrices first (its optimizer's groups
    come first), to the ranks of DP x CP in a ping-pong loop (0 .. n-1, n-1 .. 0), the experts'
    split by expert parallelism over expert DP the same way (``shard_params``); ``per_param`` and
    ``per_matrix_element``: the state per element of an Adam parameter and of a Muon matrix. The
    busiest rank of each loop is taken (the same GPU where either loop has one rank)."""
    dense: list[tuple[int, bool]] = []  # (elements, a Muon matrix) of each parameter
    experts: list[tuple[int, bool]] = []
    for stage in stages:
        for block in stage.blocks:
            matrices = [rows * columns for _, (rows, columns) in muon_matrices(block.nodes)]
            for numels, out in ((block.parameter_sizes, dense), (block.expert_parameter_numels, experts)):
                instance = []
                for numel in numels:
                    matrix = numel in matrices
                    if matrix:
                        matrices.remove(numel)
                    instance.append((numel, matrix))
                out.extend(instance * block.count)
    expert_ranks = plan.expert_data_parallel if plan.expert_parallel > 1 else plan.data_parallel * plan.context_parallel
    return sum(_busiest_rank(params, ranks, per_param, per_matrix_element)
               for params, ranks in ((dense, plan.data_parallel * plan.context_parallel), (experts, expert_ranks)))


def _busiest_rank(params: list[tuple[int, bool]], ranks: int, per_param: int, per_matrix_element: int) -> int:
    """The most state bytes one of ``ranks`` holds when ``params`` are dealt as ``shard_params`` deals them."""
    held = [0] * ranks
    loop = [*range(ranks), *reversed(range(ranks))]
    ordered = sorted(params, key=lambda p: (p[0], not p[1]))  # stable: the model's order within a size
    for i, (numel, matrix) in enumerate(ordered):
        held[loop[i % len(loop)]] += numel * (per_matrix_element if matrix else per_param)
    return max(held, default=0)


def _fsdp_held(stage: StageGraph, fsdp: FsdpSettings) -> tuple[int, int]:
    """Elements of the most consecutive units (blocks, forward order) of ``stage`` held gathered at
    once, and of those whose gradients are held unsharded (:func:`working_set_units`)."""
    numels = [b.num_parameters for b in stage.blocks for _ in range(b.count)]
    weight_units, grad_units = working_set_units(fsdp, numels)

    def window(units: int) -> int:
        return max((sum(numels[i:i + units]) for i in range(len(numels))), default=0) if units else 0

    return window(weight_units), window(grad_units)


def memory_floor_gib(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> float | None:
    """A lower bound on the peak memory of ``plan``'s busiest rank, from the model's dimensions
    alone (no trace): what a plan search prunes by before it traces or costs anything.

    Model states: the busiest pipeline rank holds at least the mean of the ranks, and the ranks of
    one TP group together hold at least the model: TP splits every weight but the routed experts
    (replicated ones count whole, a padded vocabulary more), expert TP x EP splits those. Each
    parameter takes at least its weight, its gradient and the cheaper of its optimizer states
    (Adam's, or Muon's for a matrix), the latter divided by TP x CP x DP with the distributed
    optimizer (more ranks than any group it shards over).

    Activations (:func:`activation_floor_nbytes`): at least each layer's input for every
    micro-batch the schedule certainly holds. The busiest rank holds at least the mean of the ranks'
    states plus activations, and at least the most activations of any one rank; the floor is the
    larger of the two. The allowance is :func:`rank_memory`'s. None where model states are not that
    simple: FSDP shards weights and gradients, and FP8 / FP4 weights replace the model-dtype copy.
    """
    if training.fsdp is not None or training.fp8_settings is not None:
        return None
    dtype = model.dtype
    experts = model.num_expert_parameters
    params = ((model.num_parameters - experts) / plan.tensor_parallel
              + experts / (plan.expert_parallel * plan.expert_tp)) / plan.pipeline_parallel
    states = min(training.optimizer.state_nbytes(dtype.nbytes, matrix=matrix) for matrix in (False, True))
    if training.distributed_optimizer:
        states /= plan.tensor_parallel * plan.context_parallel * plan.data_parallel
    activations = activation_floor_nbytes(model, plan, training)
    tensors = max(params * (dtype.nbytes + training.grad_dtype(dtype).nbytes + states)
                  + sum(activations) / len(activations), max(activations)) / GIB
    return tensors + RESERVED_GIB + FRAGMENTATION * tensors


def activation_floor_nbytes(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> tuple[int, ...]:
    """Per pipeline rank, a lower bound on the activation bytes it holds at its schedule's peak
    (:func:`rank_memory`'s ``peak_live``): each of its layers keeps its input, ``seq / CP x
    micro_batch x hidden`` elements of the model dtype (divided by TP with sequence parallelism),
    for each of ``min(PP - rank, m)`` micro-batches; a dense GPT layer that recomputes at most its
    core attention keeps more (:func:`_saved_per_token`).

    Why it is a lower bound: a layer's input is the residual stream its first norm reads, and every
    recompute mode keeps it: without recompute the norm saves it for its backward, selective
    recompute checkpoints the inputs of what it recomputes (``CheckpointWithoutOutput``), and full
    recompute (uniform, one layer per checkpoint, saved activations not distributed) saves exactly
    the inputs of each layer. Inputs of consecutive layers are distinct tensors (each layer's output
    is a new residual sum), so they add. A rank's forward keeps them until that micro-batch's
    backward; in megatron-core's ``schedules.py`` 1F1B runs ``PP - rank - 1`` warm-up forwards and
    one more before its first backward, so ``min(PP - rank, m)`` micro-batches are held through all
    of the rank's layers; GPipe holds all ``m``; the interleaved schedule with its default group
    size (PP micro-batches per virtual stage) runs ``(PP - rank - 1) x 2 + (VP - 1) x PP + 1``
    forwards first, which take every chunk of the rank through at least ``min(PP - rank, m)``
    micro-batches; another group size is counted as one micro-batch (a rank's first backward
    follows the forward of every one of its chunks). Activations, the gradients in flight and the
    transient of a backward only add to this. None counted (all zeros) where saved tensors may
    leave the GPU's activations: activation offloading and CUDA graphs (their pools).
    """
    layers = [sum(chunks) for chunks in plan.chunk_layers(model)]
    if training.activation_offload is not None or training.cuda_graph_impl is not CudaGraphImpl.NONE:
        return (0,) * len(layers)
    per_layer = plan.local_seq_length(model) * plan.micro_batch_size * _saved_per_token(model, plan) * model.dtype.nbytes
    microbatches = training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
    one_group = training.schedule is ScheduleKind.INTERLEAVED_1F1B and training.microbatch_group_size is not None
    held = [1 if one_group else min(plan.pipeline_parallel - rank, microbatches) for rank in range(len(layers))]
    return tuple(per_layer * count * n for count, n in zip(layers, held))


def _saved_per_token(model: ModelSpec, plan: ParallelPlan) -> int:
    """Elements one layer certainly saves per token of a micro-batch on one rank (see
    :func:`activation_floor_nbytes`). The layer's input, ``h`` (``h / TP`` with sequence
    parallelism), under any recompute; a dense GPT layer without recompute, or recomputing its core
    attention only, also keeps what its linears and norms save for backward in Megatron's and
    TransformerEngine's modules alike: the output of its first norm (the QKV GEMM's input) and the
    residual and norm output of its MLP (``h`` each, ``/ TP`` with SP; a sequence-parallel linear
    saves its shard and gathers it again in backward), the core attention's output (the
    projection's input, ``h / TP``), and FC1's output and the activation's (``ffn / TP`` each, the
    latter at least when a GLU doubles FC1). MoE, MLA and Mamba layers, and other selective
    recompute modules, count the input only."""
    sp = plan.tensor_parallel if plan.sequence_parallel else 1
    simple = (not (model.is_moe or model.is_hybrid or model.multi_latent_attention)
              and plan.recomputed_modules in ((), ("core_attn",)) and plan.recompute is not Recompute.FULL)
    if not simple:
        return model.hidden_size // sp
    return (4 * model.hidden_size // sp + model.hidden_size // plan.tensor_parallel
            + 2 * (model.ffn_size // plan.tensor_parallel))
