"""``prepare()``: a traced graph laid out as kernel batches, once per graph, software stack (and FP8
settings) and profile.

Each block's ops are lowered onto the kernels of the software stack (:mod:`vtrain_plugin.cost.lowering.stacks`)
and every block's phases are laid out as segments of one :class:`KernelBatch` per stage, with the
measured durations looked up; tensor- and context-parallel collectives, and the MoE layers'
expert-parallel ones, are rows of the batch, on the compute stream, with the kernel each can hide
behind (:mod:`vtrain_plugin.cost.comm.overlap`; the MoE layers' block it). Under context parallelism
the layers' core attention is first replaced by TransformerEngine's CP attention
(:mod:`vtrain_plugin.cost.comm.context_parallel`). Megatron's runtime collectives (DP gradients,
pipeline transfers, tied embeddings) are derived per stage
(:mod:`vtrain_plugin.cost.comm.runtime_collectives`); with the distributed optimizer the optimizer step
runs on the rank's shard (:mod:`vtrain_plugin.cost.comm.optimizer_shard`). Stages that share their blocks
(one chunk role) share one :class:`PreparedRole`, and roles prepared without measured durations are
kept across calls. This depends on the graph, the stack and the profile, not on the device constants
or the cluster:
calibration prepares each run once and re-costs it (:func:`vtrain_plugin.cost.costing.cost`) per
candidate set of constants.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import (CP_GROUPS, Block, BlockKind, CollectiveKind, CollectiveNode, KernelKey,
                                      OpGraph, OpNode, ParallelGroup, Phase, StageGraph)
from vtrain_plugin.cost.comm.overlap import overlap_partners
from vtrain_plugin.cost.comm.context_parallel import ContextParallel
from vtrain_plugin.cost.kernels.host_device import Segment
from vtrain_plugin.cost.kernels.model import KernelBatch
from vtrain_plugin.cost.kernels.timer import measured_ns
from vtrain_plugin.cost.lowering.deterministic import deterministic_kernels
from vtrain_plugin.cost.lowering.grad_hooks import GradHooks, grad_hook_adds
from vtrain_plugin.cost.lowering.logging_step import logging_passes
from vtrain_plugin.cost.lowering.optimizer_step import optimizer_step
from vtrain_plugin.cost.lowering.weight_copies import looped, weight_copies
from vtrain_plugin.capture.tracer import first_layer_numbers
from vtrain_plugin.cost.lowering.bf16_layers import bf16_edge_counts, split_bf16_layers
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.cost.comm.moe_dispatch import MOE_GROUPS
from vtrain_plugin.cost.comm.optimizer_shard import optimizer_shards, shard_optimizer
from vtrain_plugin.cost.comm.runtime_collectives import RuntimeCollectives, runtime_collectives
from vtrain_plugin.specs.fsdp import FsdpImplementation
from vtrain_plugin.specs.model import LoadBalancing
from vtrain_plugin.specs.optimizer import OptimizerKind, OptimizerSpec
from vtrain_plugin.specs.training import Fp8Settings, SoftwareStack, TrainingSpec

PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER)
_NO_KERNEL = OpNode(key=KernelKey(op="aten.empty.memory_format", input_shapes=(), dtypes=()), phase=Phase.FORWARD,
                    module="", launches_kernel=False)  # the batch row of a collective


@dataclass(frozen=True, slots=True)
class CommRow:
    """A collective on the compute stream: its row in the batch and the row of the kernel it can hide
    behind, -1 when it blocks (:mod:`vtrain_plugin.cost.comm.overlap`)."""

    row: int
    node: CollectiveNode
    partner: int = -1


@dataclass(frozen=True, slots=True, eq=False)
class PreparedRole:
    """The kernel batch of the stages that share their blocks (one traced chunk role).

    Tracing folds the layers of every chunk of one role onto the same node tuples, so the stages
    of a role (all middle stages of a pipeline, and every plan of the same shapes) share one of
    these: prepared once, costed once per rank placement.
    """

    blocks: tuple[Block, ...]
    kernels: KernelBatch  # every segment's kernels in order; collectives are rows of kind NONE
    measured_ns: np.ndarray  # per row, NaN where unmeasured
    nodes: tuple[OpNode | None, ...]  # per row (None for a collective)
    comm_rows: tuple[CommRow, ...]  # rows holding TP, CP and the MoE layers' (cost.moe.MOE_GROUPS) collectives
    segments: tuple[Segment, ...]  # blocks in stage order, phases in PHASES order
    flops: dict[Phase, int]  # model FLOPs of one micro-batch through this chunk, on one TP and CP rank
    module_calls: np.ndarray  # per row: 1 where a module call's host work starts (see host_calls)
    layer_calls: np.ndarray  # per row: 1 where a transformer layer's own host work starts


def host_calls(nodes: list[OpNode | None], segments: list[Segment], blocks: tuple[Block, ...]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Where the framework's per-module and per-layer host work falls, as row flags.

    Every module that issues kernels is called once per layer and phase (forward, recompute,
    backward; the optimizer step is no module call): its host work is put before its first kernel
    of the segment. A transformer layer's own work (its Python, the checkpoint wrapper) is put before
    the first kernel of each of its forward, recompute and backward segments.
    """
    modules = np.zeros(len(nodes))
    layers = np.zeros(len(nodes))
    for s in segments:
        if s.phase is Phase.OPTIMIZER or s.stop == s.start:
            continue
        seen: set[str] = set()
        for row in range(s.start, s.stop):
            node = nodes[row]
            if node is not None and node.module not in seen:
                seen.add(node.module)
                modules[row] = 1.0
        if blocks[s.block].kind is BlockKind.LAYER:
            layers[s.start] = 1.0
    return modules, layers


@dataclass(frozen=True, slots=True)
class PreparedStage:
    stage: StageGraph
    role: PreparedRole
    runtime: RuntimeCollectives


@dataclass(frozen=True, slots=True)
class PreparedGraph:
    graph: OpGraph
    stack: SoftwareStack
    distributed_optimizer: bool
    stages: tuple[PreparedStage, ...]  # in virtual-stage order (chunk * pp + pipeline_rank)
    flops: dict[Phase, int]  # of one micro-batch through every chunk, on one tensor-parallel rank


_ROLE_CACHE_SIZE = 256
# Roles lowered without measured durations, kept across calls: a plan search lowers each chunk role
# once, whatever the block counts of its plans (PP and VP only change counts). Keyed by the identity
# of the blocks' node tuples (the entry holds them, so no other tuple can take their id while it lives).
_roles: OrderedDict[tuple, _Lowered] = OrderedDict()


@dataclass(frozen=True, slots=True, eq=False)
class _Lowered:
    """A :class:`PreparedRole` before its blocks are counted: all of it that depends on the blocks'
    nodes alone, shared by the stages (and plans) that fold the same nodes to other counts."""

    node_tuples: tuple[tuple, ...]  # the blocks' nodes, held so their ids stay theirs (see _roles)
    kernels: KernelBatch
    measured_ns: np.ndarray
    nodes: tuple[OpNode | None, ...]
    comm_rows: tuple[CommRow, ...]
    segments: tuple[Segment, ...]  # each of count 1
    block_flops: tuple[dict[Phase, int], ...]  # per block, of one instance
    module_calls: np.ndarray
    layer_calls: np.ndarray

    def counted(self, blocks: tuple[Block, ...]) -> PreparedRole:
        """The role of ``blocks`` (these nodes, any counts)."""
        return PreparedRole(
            blocks=blocks, kernels=self.kernels, measured_ns=self.measured_ns, nodes=self.nodes,
            comm_rows=self.comm_rows, segments=tuple(replace(s, count=blocks[s.block].count) for s in self.segments),
            flops={phase: sum(b.count * f[phase] for b, f in zip(blocks, self.block_flops)) for phase in PHASES},
            module_calls=self.module_calls, layer_calls=self.layer_calls)


def prepare(graph: OpGraph, stack: SoftwareStack | str, measured: Mapping[KernelKey, float] | None = None, *,
            fp8: Fp8Settings | None = None, distributed_optimizer: bool = False, grads: Dtype | None = None,
            fp8_param_gather: bool = False, kernels: KernelOptions | None = None) -> PreparedGraph:
    """Lay ``graph`` out for costing under ``stack`` (GEMMs in FP8 with ``fp8``), with ``measured``
    kernel durations (ns), Megatron-Core's ``distributed_optimizer`` or not, gradients reduced in
    ``grads`` and FP8 weights all-gathered with ``fp8_param_gather``
    (:func:`vtrain_plugin.cost.comm.runtime_collectives.runtime_collectives`); ``kernels``: the
    run's optimizer, deterministic mode and attention backend (None: Adam, TE's fused attention)."""
    stack = SoftwareStack(stack)
    shards = optimizer_shards(graph.parallel, distributed_optimizer)
    cp = ContextParallel.of(graph)
    pp = graph.parallel.pipeline_parallel
    last = graph.parallel.num_model_chunks - 1
    ordered = sorted(graph.stages, key=lambda s: s.chunk * pp + s.pipeline_rank)
    tied = graph.model is not None and graph.model.tied
    options = _moe_options(graph)
    if kernels is not None and kernels != KernelOptions():
        options = (*options, replace(kernels, tensor_parallel=graph.parallel.tensor_parallel,
                                     expert_tensor_parallel=graph.parallel.expert_tp))
    roles: dict[tuple, PreparedRole] = {}
    runtimes: dict[tuple, RuntimeCollectives] = {}
    # Stages of one role share their blocks' tuple (folded once by the tracer): a stage whose tuple,
    # embedding, activation and place (first, last virtual stage) were seen takes that stage's role
    # and runtime collectives by reference. Where layers at the edges leave FP8 each stage is split.
    alike: dict[tuple, tuple[PreparedRole, RuntimeCollectives]] = {}
    stages = []
    edges = _bf16_edges(graph, fp8)
    for stage in ordered:
        virtual = stage.chunk * pp + stage.pipeline_rank
        seen = None if edges else (id(stage.blocks), stage.word_embedding_parameters, stage.activation_shape,
                                   stage.activation_dtype, virtual == 0, virtual == last)
        shared = alike.get(seen) if seen is not None else None
        if shared is None:
            stage, outside_fp8 = split_bf16_layers(stage, edges(stage)) if edges else (stage, ())
            role_key = (stack, fp8, shards, cp, tuple(_lowered_by(b) for b in stage.blocks), outside_fp8, *options)
            counts = tuple(b.count for b in stage.blocks)
            role = roles.get((role_key, counts))
            if role is None:
                role = roles[role_key, counts] = _role(stage.blocks, stack, fp8, shards, cp, measured, role_key,
                                                       options, outside_fp8)
            runtime_key = (role_key, tuple(b.num_parameters for b in stage.blocks), stage.word_embedding_parameters,
                           stage.activation_shape, stage.activation_dtype, virtual == 0, virtual == last)
            runtime = runtimes.get(runtime_key)
            if runtime is None:
                runtime = runtimes[runtime_key] = runtime_collectives(stage, graph.parallel, dtype=graph.dtype,
                                                                      tied_embeddings=tied,
                                                                      distributed_optimizer=distributed_optimizer,
                                                                      grads=grads, fp8_param_gather=fp8_param_gather)
            shared = (role, runtime)
            if seen is not None:
                alike[seen] = shared
        stages.append(PreparedStage(stage=stage, role=shared[0], runtime=shared[1]))
    flops = _graph_flops(stages)
    return PreparedGraph(graph=graph, stack=stack, distributed_optimizer=distributed_optimizer, stages=tuple(stages),
                         flops=flops)


def _lowered_by(block: Block) -> tuple:
    """What of ``block`` its lowering reads (its counts aside): its node tuple, by identity (blocks of
    other chunk roles may share it: the trace cache hands equal tuples out as one), and its kind and
    parameters."""
    return id(block.nodes), block.kind, block.num_parameters, block.parameter_numels, block.expert_parameter_numels


def _graph_flops(stages: list[PreparedStage]) -> dict[Phase, int]:
    """Of one micro-batch through every stage: each distinct role's FLOPs times its stages."""
    uses = Counter(id(stage.role) for stage in stages)
    roles = {id(stage.role): stage.role for stage in stages}
    return {phase: sum(n * roles[role].flops[phase] for role, n in uses.items()) for phase in PHASES}


def prepare_run(graph: OpGraph, stack: SoftwareStack | str, training: TrainingSpec,
                measured: Mapping[KernelKey, float] | None = None) -> PreparedGraph:
    """:func:`prepare` with the options of ``training``: FP8, the optimizer on a data-parallel
    shard (the distributed optimizer, or FSDP's), the gradient dtype, the FP8 parameter all-gather and
    the kernel options (optimizer, deterministic kernels, unfused attention, DDP's gradient hooks)."""
    return prepare(graph, stack, measured, **run_options(training, graph.dtype, SoftwareStack(stack)))


def run_options(training: TrainingSpec, dtype: Dtype, stack: SoftwareStack) -> dict[str, object]:
    """The options :func:`prepare_run` gives :func:`prepare` for ``training`` and a graph of ``dtype``
    on ``stack``: all it reads of the training spec (hashable values, so callers that prepare many
    plans key a prepared graph by them: :func:`run_options_key`)."""
    return dict(fp8=training.fp8_settings, distributed_optimizer=training.shards_optimizer,
                grads=training.grad_dtype(dtype), fp8_param_gather=training.fp8_param_gather,
                kernels=KernelOptions(optimizer=training.optimizer, deterministic=training.deterministic,
                                      unfused_attention=training.unfused_attention,
                                      unfused=training.unfused_kernels,
                                      log_params_norm=training.log_params_norm,
                                      log_num_zeros_in_grad=training.log_num_zeros_in_grad,
                                      grad_hooks=_grad_hooks(dtype, stack, training),
                                      weight_copies=_weight_copies(dtype, stack, training)))


def run_options_key(training: TrainingSpec, dtype: Dtype, stack: SoftwareStack) -> tuple:
    """:func:`run_options` as a hashable key: two training specs of one key prepare a graph alike."""
    return tuple(run_options(training, dtype, stack).items())


def _grad_hooks(dtype: Dtype, stack: SoftwareStack, training: TrainingSpec) -> GradHooks | None:
    """Megatron-Core's per-parameter gradient hook (:mod:`vtrain_plugin.cost.lowering.grad_hooks`): the
    Megatron-Core stacks with DDP or Megatron-FSDP (torch FSDP2 has none)."""
    fsdp = training.fsdp
    if stack not in MEGATRON_CORE_STACKS or (fsdp is not None and fsdp.implementation is not FsdpImplementation.MEGATRON):
        return None
    return GradHooks(fused_weights=training.gradient_accumulation_fusion, grad=dtype,
                     main_grad=training.grad_dtype(dtype),
                     copies=fsdp is not None and fsdp.sharding_strategy.shards_gradients)


def _weight_copies(dtype: Dtype, stack: SoftwareStack, training: TrainingSpec) -> Dtype | None:
    """The model dtype when megatron-core copies the main weights into it one parameter at a time
    (:mod:`vtrain_plugin.cost.lowering.weight_copies`), else None."""
    if (stack not in MEGATRON_CORE_STACKS or training.optimizer.kind is OptimizerKind.MUON
            or not looped(dtype, distributed_optimizer=training.distributed_optimizer or training.fsdp is not None,
                          precision_aware=training.optimizer.precision_aware,
                          torch_fsdp=training.fsdp is not None
                          and training.fsdp.implementation is FsdpImplementation.TORCH)):
        return None  # Muon: megatron-core's layer-wise optimizer, not modelled here
    return dtype


def _bf16_edges(graph: OpGraph, fp8: Fp8Settings | None):
    """Per stage, the instances of its blocks outside FP8 (:mod:`vtrain_plugin.cost.lowering.bf16_layers`);
    None when every layer runs in FP8."""
    if fp8 is None or not (fp8.bf16_layers_at_start or fp8.bf16_layers_at_end) or graph.model is None:
        return None
    first = first_layer_numbers(graph.model, graph.parallel)
    return lambda stage: bf16_edge_counts(stage, first[stage.pipeline_rank][stage.chunk], graph.model.num_layers, fp8)


def _moe_options(graph: OpGraph) -> tuple:
    """What of the model the preparation of its roles reads besides their nodes: whether MoE
    experts run as grouped GEMMs, whether the shared expert overlaps the all-to-all and whether the
    permutation and the router run TE's fused kernels (only when set, so the role keys of other models
    stay as they were; sinkhorn routing has no fused router)."""
    model = graph.model
    if model is None or not model.is_moe:
        return ()
    router_fusion = model.moe_router_fusion and model.moe_router_load_balancing_type is not LoadBalancing.SINKHORN
    if not (model.moe_grouped_gemm or model.moe_shared_expert_overlap or model.moe_permute_fusion or router_fusion):
        return ()
    return (MoeOptions(grouped_experts=model.moe_grouped_gemm, shared_expert_overlap=model.moe_shared_expert_overlap,
                       permute_fusion=model.moe_permute_fusion, router_fusion=router_fusion),)


@dataclass(frozen=True, slots=True)
class MoeOptions:
    grouped_experts: bool = False
    shared_expert_overlap: bool = False
    permute_fusion: bool = False  # TE's fused permutation kernels (cost.lowering.moe_fusion)
    router_fusion: bool = False  # TE's fused router kernels (cost.lowering.moe_fusion)


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """What of the training spec changes a role's kernels besides FP8 and the stack: the optimizer
    (:mod:`vtrain_plugin.cost.lowering.optimizer_step`), deterministic mode
    (:mod:`vtrain_plugin.cost.lowering.deterministic`) and TE's unfused attention; the TP sizes
    Muon gathers its weights over (filled by :func:`prepare`)."""

    optimizer: OptimizerSpec = OptimizerSpec()
    deterministic: bool = False
    unfused_attention: bool = False
    unfused: tuple[str, ...] = ()  # Megatron's jit fusions turned off (training.unfused_kernels)
    tensor_parallel: int = 1
    expert_tensor_parallel: int = 1
    log_params_norm: bool = False  # Megatron-LM's per-step logging passes (cost.lowering.logging_step)
    log_num_zeros_in_grad: bool = False
    grad_hooks: GradHooks | None = None  # DDP's main_grad adds (cost.lowering.grad_hooks); None: none
    # The model dtype where the main weights are copied one parameter at a time
    # (cost.lowering.weight_copies); None: the stack's multi-tensor pass.
    weight_copies: Dtype | None = None


MEGATRON_CORE_STACKS = (SoftwareStack.MEGATRON_CORE_TE, SoftwareStack.MEGATRON_CORE_LOCAL)


def _role(blocks: tuple[Block, ...], stack: SoftwareStack, fp8: Fp8Settings | None, shards: tuple[int, int],
          cp: ContextParallel | None, measured: Mapping[KernelKey, float] | None, key: tuple,
          options: tuple = (), outside_fp8: tuple[bool, ...] = ()) -> PreparedRole:
    moe = next((o for o in options if isinstance(o, MoeOptions)), MoeOptions())
    kernels = next((o for o in options if isinstance(o, KernelOptions)), KernelOptions())
    if measured:
        return _lower_role(blocks, stack, fp8, shards, cp, measured, moe, kernels, outside_fp8).counted(blocks)
    lowered = _roles.get(key)
    if lowered is None:
        lowered = _roles[key] = _lower_role(blocks, stack, fp8, shards, cp, {}, moe, kernels, outside_fp8)
        if len(_roles) > _ROLE_CACHE_SIZE:
            _roles.popitem(last=False)
    else:
        _roles.move_to_end(key)
    return lowered.counted(blocks)


def _lower_role(blocks: tuple[Block, ...], stack: SoftwareStack, fp8: Fp8Settings | None, shards: tuple[int, int],
                cp: ContextParallel | None, measured: Mapping[KernelKey, float],
                moe: MoeOptions = MoeOptions(), kernels: KernelOptions = KernelOptions(),
                outside_fp8: tuple[bool, ...] = ()) -> _Lowered:
    """``outside_fp8[b]``: block ``b`` runs in the model dtype whatever ``fp8`` says. Each block's
    forward, backward and recompute rows are laid out once (:func:`_body`) for every optimizer
    sharding; its optimizer step (:func:`_step`) per sharding."""
    pieces: list[_Piece] = []
    block_flops = []
    for b, block in enumerate(blocks):
        block_fp8 = None if outside_fp8 and outside_fp8[b] else fp8
        body = _body(block, stack, block_fp8, cp, moe, kernels)
        pieces.extend((body, _step(block, stack, block_fp8, cp, moe, kernels, shards)))
        block_flops.append(body.flops)
    rows: list[OpNode | None] = []
    comm_rows: list[CommRow] = []
    segments: list[Segment] = []
    for i, piece in enumerate(pieces):
        offset = len(rows)
        rows.extend(piece.rows)
        comm_rows.extend(CommRow(row=offset + c.row, node=c.node, partner=-1 if c.partner < 0 else offset + c.partner)
                         for c in piece.comm_rows)
        segments.extend(Segment(block=i // 2, phase=phase, start=offset + start, stop=offset + stop, count=1)
                        for phase, start, stop in piece.bounds)
    return _Lowered(node_tuples=tuple(b.nodes for b in blocks), kernels=KernelBatch.concat([p.kernels for p in pieces]),
                    measured_ns=measured_ns(rows, measured), nodes=tuple(rows), comm_rows=tuple(comm_rows),
                    segments=tuple(segments), block_flops=tuple(block_flops),
                    module_calls=np.concatenate([p.module_calls for p in pieces]),
                    layer_calls=np.concatenate([p.layer_calls for p in pieces]))


@dataclass(frozen=True, slots=True, eq=False)
class _Piece:
    """Some phases of one block laid out as rows of a role's batch, rows counted from the piece's
    first: their nodes (None for a collective), collectives, each phase's rows, kernels and host
    calls (:func:`host_calls`); the forward, backward and recompute piece also holds the FLOPs of one
    instance per phase (:func:`_phase_flops`)."""

    traced: tuple  # the block's traced nodes, held so their id stays theirs (see _bodies)
    rows: tuple[OpNode | None, ...]
    comm_rows: tuple[CommRow, ...]
    bounds: tuple[tuple[Phase, int, int], ...]
    kernels: KernelBatch
    module_calls: np.ndarray
    layer_calls: np.ndarray
    flops: dict[Phase, int] | None = None


_BODY_CACHE_SIZE = 512
# A block's forward, backward and recompute rows: the same for every optimizer sharding, so the
# plans of one shape with and without the distributed optimizer, and over several DP sizes, lay them
# out once. Keyed by the identity of the traced nodes (the entry holds them, as _roles does).
_bodies: OrderedDict[tuple, _Piece] = OrderedDict()
_BODY_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE)


def _body(block: Block, stack: SoftwareStack, fp8: Fp8Settings | None, cp: ContextParallel | None, moe: MoeOptions,
          kernels: KernelOptions) -> _Piece:
    key = (id(block.nodes), block.kind, block.num_parameters, block.parameter_numels, block.expert_parameter_numels,
           stack, fp8, cp, moe, kernels.unfused_attention, kernels.unfused, kernels.deterministic, kernels.grad_hooks)
    known = _bodies.get(key)
    if known is not None:
        _bodies.move_to_end(key)
        return known
    mapped = grad_hook_adds(_block_mapped(block, stack, fp8, cp, moe, kernels), block, kernels.grad_hooks)
    piece = _bodies[key] = replace(_piece(block, mapped, _BODY_PHASES, moe), flops=_phase_flops(block, cp))
    if len(_bodies) > _BODY_CACHE_SIZE:
        _bodies.popitem(last=False)
    return piece


_STEP_CACHE_SIZE = 1024
# A block's optimizer step on one sharding: the roles that hold the block (a plan shape's first,
# middle and last stages, each number of layers built) lay it out once per sharding. Keyed by the
# identity of the traced nodes (the entry holds them, as _roles does).
_steps: OrderedDict[tuple, _Piece] = OrderedDict()


def _step(block: Block, stack: SoftwareStack, fp8: Fp8Settings | None, cp: ContextParallel | None, moe: MoeOptions,
          kernels: KernelOptions, shards: tuple[int, int]) -> _Piece:
    """The block's optimizer step on its shard (no hook adds: they are backward kernels)."""
    key = (id(block.nodes), block.kind, block.parameter_numels, block.expert_parameter_numels, block.num_parameters,
           stack, fp8, cp, moe, kernels, shards)
    known = _steps.get(key)
    if known is not None:
        _steps.move_to_end(key)
        return known
    piece = _steps[key] = _lay_out_step(block, stack, fp8, cp, moe, kernels, shards)
    if len(_steps) > _STEP_CACHE_SIZE:
        _steps.popitem(last=False)
    return piece


def _lay_out_step(block: Block, stack: SoftwareStack, fp8: Fp8Settings | None, cp: ContextParallel | None,
                  moe: MoeOptions, kernels: KernelOptions, shards: tuple[int, int]) -> _Piece:
    mapped = tuple(n for n in _block_mapped(block, stack, fp8, cp, moe, kernels) if n.phase is Phase.OPTIMIZER)
    mapped = shard_optimizer(mapped, *shards)
    if kernels.weight_copies is not None:
        mapped = weight_copies(mapped, block, kernels.weight_copies, *shards)
    mapped = optimizer_step(mapped,
                            kernels.optimizer, traced=block.nodes, tensor_parallel=kernels.tensor_parallel,
                            expert_tensor_parallel=kernels.expert_tensor_parallel, shards=shards[0],
                            expert_shards=shards[1])
    mapped = logging_passes(mapped, params_norm=kernels.log_params_norm, num_zeros=kernels.log_num_zeros_in_grad)
    return _piece(block, mapped, (Phase.OPTIMIZER,), moe)


def _block_mapped(block: Block, stack: SoftwareStack, fp8: Fp8Settings | None, cp: ContextParallel | None,
                  moe: MoeOptions, kernels: KernelOptions) -> tuple:
    layer = block.kind is BlockKind.LAYER
    nodes = cp.layer_nodes(block.nodes) if cp is not None and layer else block.nodes
    return _mapped(block.nodes, nodes, stack, fp8, cp, moe.grouped_experts, kernels.unfused_attention,
                   kernels.deterministic, kernels.unfused, moe.permute_fusion, moe.router_fusion)


def _piece(block: Block, mapped: tuple, phases: tuple[Phase, ...], moe: MoeOptions) -> _Piece:
    """The rows of ``phases`` of ``mapped`` (one block's lowered nodes): its kernels and the
    collectives on the compute stream, each with the kernel it can hide behind."""
    layer = block.kind is BlockKind.LAYER
    by_phase: dict[Phase, list[OpNode | CollectiveNode]] = {p: [] for p in phases}
    for node in mapped:
        if node.phase not in by_phase:
            continue
        if isinstance(node, OpNode):
            if node.launches_kernel:
                by_phase[node.phase].append(node)
        elif _on_compute_stream(node):
            by_phase[node.phase].append(node)
    rows: list[OpNode | None] = []
    backward: list[bool] = []
    comm_rows: list[CommRow] = []
    bounds: list[tuple[Phase, int, int]] = []
    for phase in phases:
        start = len(rows)
        partners = overlap_partners(by_phase[phase], in_layer=layer, shared_expert_overlap=moe.shared_expert_overlap)
        for i, node in enumerate(by_phase[phase]):
            if isinstance(node, CollectiveNode):
                partner = partners.get(i)
                comm_rows.append(CommRow(row=len(rows), node=node, partner=-1 if partner is None else start + partner))
                rows.append(None)
            else:
                rows.append(node)
        backward.extend([phase is Phase.BACKWARD] * (len(rows) - start))
        bounds.append((phase, start, len(rows)))
    batch = KernelBatch.of([n if n is not None else _NO_KERNEL for n in rows])
    batch = replace(batch, backward=np.array(backward, bool))
    module_calls, layer_calls = host_calls(rows, [Segment(block=0, phase=phase, start=start, stop=stop, count=1)
                                                  for phase, start, stop in bounds], (block,))
    return _Piece(traced=block.nodes, rows=tuple(rows), comm_rows=tuple(comm_rows), bounds=tuple(bounds),
                  kernels=batch, module_calls=module_calls, layer_calls=layer_calls)


def _phase_flops(block: Block, cp: ContextParallel | None) -> dict[Phase, int]:
    """``model_flops`` of one instance of ``block`` in each phase, in one pass over its nodes."""
    flops = dict.fromkeys(PHASES, 0)
    count = (lambda op: op.flops) if cp is None else cp.model_flops
    for op in block.ops():
        flops[op.phase] += count(op)
    return flops


_MAPPED_CACHE_SIZE = 256
# A block's nodes as a stack runs them, before its optimizer step is sharded: the roles of the plans
# with and without the distributed optimizer share it. Keyed by the identity of the traced nodes
# (the entry holds them, as _roles does).
_mapped_nodes: OrderedDict[tuple, tuple[tuple, tuple[OpNode | CollectiveNode, ...]]] = OrderedDict()


def _mapped(traced: tuple, nodes: tuple, stack: SoftwareStack, fp8: Fp8Settings | None, cp: ContextParallel | None,
            grouped_experts: bool, unfused_attention: bool, deterministic: bool, unfused: tuple[str, ...] = (),
            permute_fusion: bool = False, router_fusion: bool = False) -> tuple:
    """``nodes`` (``traced``, under CP with its CP attention) lowered onto ``stack``'s kernels."""
    key = (id(traced), nodes is traced, stack, fp8, cp, grouped_experts, unfused_attention, deterministic, unfused,
           permute_fusion, router_fusion)
    known = _mapped_nodes.get(key)
    if known is not None:
        _mapped_nodes.move_to_end(key)
        return known[1]
    mapped = map_nodes(nodes, stack, fp8, grouped_experts=grouped_experts, unfused_attention=unfused_attention,
                       unfused=unfused, permute_fusion=permute_fusion, router_fusion=router_fusion)
    if deterministic:
        mapped = deterministic_kernels(mapped)
    _mapped_nodes[key] = (traced, mapped)
    if len(_mapped_nodes) > _MAPPED_CACHE_SIZE:
        _mapped_nodes.popitem(last=False)
    return mapped


def _on_compute_stream(node: CollectiveNode) -> bool:
    """TP collectives, the MoE layers' collectives and CP transfers run in the layer's order; a CP
    ring step's receive is the other half of its send (one batched exchange), timed once, with the send."""
    return (node.group is ParallelGroup.TP or node.group in MOE_GROUPS
            or (node.group in CP_GROUPS and node.kind is not CollectiveKind.RECV))
