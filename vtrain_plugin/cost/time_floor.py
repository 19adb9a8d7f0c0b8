"""A lower bound on a plan's estimated iteration time from the model's dimensions alone (no trace).

:func:`iteration_floor_ns` counts the weight GEMMs and core attention every traced layer certainly
runs at the GEMM ceiling, the tensor-parallel collectives that certainly block the compute stream, along the
pipeline's critical path, and the data-parallel gradient reduction that certainly occupies its own
stream, each at the fastest rate any calibration gives it; :func:`gemm_peak_flop_per_ns` is the peak
both this floor and an estimate's MFU are against.

Why: a search that needs only its best plans (``vtrain size``) orders plans by this floor and stops
costing once the next floor exceeds the best plan found (:mod:`vtrain_plugin.planning.bounded`); a
floor that ever exceeded an estimate would skip a plan that could have won, so every term below is
one the estimator certainly spends, and the terms it cannot prove are left out.

Why it is a lower bound of what :func:`vtrain_plugin.estimate.predict` computes:

- a GEMM's modeled device time is ``max(flops / (peak x efficiency), bytes / bandwidth) +
  overhead`` with ``efficiency = gemm_efficiency x tile fill`` (``cost/kernels/model.py``): tile
  fill is at most 1 (the tiles cover the output, the K-loop steps cover K), a calibration holds
  ``gemm_efficiency`` to the top of its range, 0.859, and to the device's measured ceiling
  (:func:`~vtrain_plugin.hardware.calibration.constant_range`), and the slowest-GPU factor is at
  least 1: so at least ``flops / (peak x that top)``. The peak is the fastest rate any GEMM of the
  plan may use (FP4 / FP8 with those recipes, else the model dtype's, TF32 for fp32). A *measured*
  kernel faster than that would break this; the bounded search checks every estimate it makes
  against its floor and falls back to costing every plan if one ever is below;
- counted: per token and layer ``2 x`` (forward), ``4 x`` (data and weight gradients) and, under
  full recompute, another ``2 x`` the weight elements of the attention projections (MLA's without
  its norms), the dense MLP (2 or 3 GEMMs), a MoE layer's ``topk`` experts plus shared experts
  (dropless only: a capacity factor may drop pairs, so its routed experts are left out), and the
  output layer's ``h x vocab`` (unpadded) on the last stage. Left out, each only adding time: Mamba
  mixers, multi-token prediction, every memory-bound kernel, kernel and host overheads, the
  optimizer, the other collectives, failures and checkpoints;
- core attention, without a sliding window (whose kernels score only the pairs in it) and without
  CP (whose ranks score unequal shares of the pairs): the causal half of the score and context
  products (:func:`~vtrain_plugin.cost.megatron_flops.attention_terms`; the unfused stack's matmuls
  compute every pair, a fused kernel's FLOPs are the causal half) in the forward, again under full
  recompute or selective recompute of ``core_attn``, and at least twice that in the backward (4
  matmuls unfused, 2.5 x fused), at the peak times the larger top of ``gemm_efficiency`` and
  ``attention_efficiency``;
- TP, CP, EP and DP divide those FLOPs over the ranks that run them; a MoE layer's traced rank is
  the busiest (or, balanced, at least the mean: the remainder pairs go to the first experts);
- tensor-parallel collectives, without ``tp_comm_overlap`` (then nothing hides them: they run on the
  compute stream, ``cost/costing.py``) and in the model dtype (not FP8 / FP4, whose all-gathers may
  be narrower): megatron-core's standard attention and dense MLP each reduce their ``tokens x h``
  output over TP in the forward (an all-reduce; with sequence parallelism an all-gather of the
  input and a reduce-scatter of the output) and the input gradient in the backward (likewise), and
  full recompute repeats the forward's. Either form moves ``2 (n-1)/n`` of the ``tokens x h`` tensor
  per GPU in ``2 (n-1)`` ring steps; counted once per layer, pass and such block (MLA, MoE and Mamba
  blocks: none). Every collective model of ``cost/comm/collectives.py`` takes at least its size term
  at the group's ring rate ``B`` with ``network_efficiency`` 1 (above its calibrated range; a tree
  moves the same bytes at under half that rate), and a group inside one node at least its ring
  steps' NVLink latency (alpha-beta, and the measured tables' interpolation from that latency at
  zero bytes; every shipped table's bus bandwidth is below the NVLink rate);
- each rank's tasks run one after another on its compute stream (``sim/task_graph.py``: a task ends
  at ``max(previous end, dependency end + send) + duration``), so the iteration is at least the
  busiest rank's ``m`` micro-batches of work, and at least the last rank's work after micro-batch
  0's forward through the first chunk of every earlier rank, followed by the last micro-batch's
  backward back through them (the last task of every rank is its first chunk's last backward);
- the gradients of a rank's attention, dense MLP and shared-expert weights are reduced over its DP
  group (DP x CP ranks), one bucket after another on the rank's DP stream, which (with the
  distributed optimizer in one instance) also all-gathers the parameters, before the first forwards
  (``overlap_param_gather``) or after the optimizer step; the optimizer starts when every rank's
  gradients are reduced (``sim/engine.py``). So the iteration is at least the DP stream's reductions
  (all-reduce ``2 (n-1)/n``, reduce-scatter ``(n-1)/n`` of the gradient bytes) and overlapped
  gathers (``(n-1)/n`` of the parameter bytes) at the ring rate, plus the gathers after the step;
  and with ``grad_reduce: after_backward`` the reductions start when the rank's compute ends.
  FSDP and several optimizer instances reduce otherwise: left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from vtrain_plugin.core.dtypes import Dtype, canonical_dtype
from vtrain_plugin.core.graph import ParallelGroup
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.megatron_flops import FORWARD_BACKWARD, attention_terms
from vtrain_plugin.hardware.calibration import constant_range
from vtrain_plugin.hardware.devices import DeviceSpec, get_device
from vtrain_plugin.specs import hybrid
from vtrain_plugin.specs.attention import mla_dim
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.pipeline_split import stage_layers
from vtrain_plugin.specs.training import Fp8Recipe, GradReduce, TrainingSpec

ATTENTION_BACKWARD_PER_FORWARD = 2  # at least: the unfused stack's 4 matmuls; a fused kernel's 2.5 x
FORWARD_FLOPS_PER_WEIGHT = 2  # one multiply-add per weight element and token
BACKWARD_FLOPS_PER_WEIGHT = 4  # the data-gradient and the weight-gradient GEMM


def gemm_precision(dtype: str, training: TrainingSpec) -> tuple[str, str]:
    """The precision a plan's fastest GEMMs run in and its name: FP4 with an FP4 recipe (NVFP4), FP8
    with an FP8 one (MXFP8 at the FP8 rate), else the model dtype (TF32 for fp32)."""
    if training.fp4 is not None:
        return Dtype.FP4.value, training.fp4_recipe.value
    if training.fp8 is not None:
        return Dtype.FP8.value, "mxfp8" if training.fp8_recipe is Fp8Recipe.MXFP8 else "fp8"
    kind = canonical_dtype(dtype)
    return dtype, "tf32" if kind is Dtype.FP32 else kind.value


def gemm_peak_flop_per_ns(device: DeviceSpec, dtype: str, training: TrainingSpec) -> float:
    """The device's dense tensor-core peak for :func:`gemm_precision`."""
    return device.tensor_flop_per_ns(gemm_precision(dtype, training)[0])


def layer_weight_elements(model: ModelSpec, *, routed_experts: bool = True) -> tuple[int, ...]:
    """Per transformer layer, the weight elements its GEMMs certainly multiply each token by,
    split over TP (and, for routed experts, EP x expert TP): see the module doc. Without
    ``routed_experts``: the weights reduced over the DP group (attention, dense MLP, shared experts)."""
    h = model.hidden_size
    gemms = 3 if model.layer.gated_linear_unit else 2
    projections, _ = attention_terms(model)
    if model.multi_latent_attention:  # Megatron's count adds one FLOP per latent element for the norms
        projections -= mla_dim(model, "kv_lora_rank") + (model.q_lora_rank or 0)
    routed = model.moe_expert_capacity_factor is None and routed_experts  # dropless: every pair computed
    expert = h * gemms * (model.expert_ffn_size * model.router_topk * routed
                          + (model.moe_shared_expert_intermediate_size or 0))
    dense = h * gemms * model.ffn_size
    if model.is_hybrid:
        kinds = {hybrid.ATTENTION: projections, hybrid.MLP: dense, hybrid.MOE: expert, hybrid.MAMBA: 0}
        return tuple(kinds[kind] for kind in model.hybrid_layer_pattern)
    return tuple(projections + (expert if moe else dense) for moe in model.moe_layer_pattern)


def layer_attentions(model: ModelSpec) -> tuple[int, ...]:
    """Per transformer layer, 1 where it runs core attention, else 0."""
    if model.is_hybrid:
        return tuple(int(kind == hybrid.ATTENTION) for kind in model.hybrid_layer_pattern)
    return (1,) * model.num_layers


def layer_tp_reductions(model: ModelSpec) -> tuple[int, ...]:
    """Per transformer layer, its blocks that reduce a ``tokens x h`` tensor over TP once per pass
    (standard attention, dense MLP): see the module doc."""
    attention = 0 if model.multi_latent_attention else 1
    if model.is_hybrid:
        kinds = {hybrid.ATTENTION: attention, hybrid.MLP: 1, hybrid.MOE: 0, hybrid.MAMBA: 0}
        return tuple(kinds[kind] for kind in model.hybrid_layer_pattern)
    return tuple(attention + (not moe) for moe in model.moe_layer_pattern)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTerms:
    """What a plan's floor reads of the model and the cluster, whatever its training options; per
    pipeline rank, or ``[rank][chunk]``: its layers' weights and TP-reducing blocks, the weights it
    reduces over DP (split over TP), and its TP and DP groups' sizes, ring rates and ring-step latency."""

    stage_weights: tuple[tuple[int, ...], ...]
    stage_reductions: tuple[tuple[int, ...], ...]
    stage_attentions: tuple[tuple[int, ...], ...]
    dp_weights: tuple[int, ...]
    tp_bytes_per_ns: tuple[float, ...]
    tp_step_latency_ns: tuple[float, ...]  # 0 for a group spanning nodes
    dp_size: tuple[int, ...]
    dp_bytes_per_ns: tuple[float, ...]


@lru_cache(maxsize=16)
def _layer_terms(model: ModelSpec) -> tuple[tuple[int, ...], ...]:
    return (layer_weight_elements(model), layer_tp_reductions(model), layer_attentions(model),
            layer_weight_elements(model, routed_experts=False))


def terms_key(plan: ParallelPlan) -> tuple:
    """What :func:`plan_terms` reads of ``plan``: the layout (group sizes, rank order, CP all-to-all
    ranks, optimizer instances) and the pipeline split; plans equal in it share their terms."""
    return (plan.tensor_parallel, plan.context_parallel, plan.pipeline_parallel, plan.virtual_pipeline,
            plan.data_parallel, plan.expert_parallel, plan.expert_tp, plan.tp_pp_dp_mapping, plan.cp_a2a_size,
            plan.distributed_optimizer_instances, plan.decoder_first_pipeline_num_layers,
            plan.decoder_last_pipeline_num_layers, plan.account_for_embedding_in_pipeline_split,
            plan.account_for_loss_in_pipeline_split, plan.pipeline_layout)


def plan_terms(model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec) -> PlanTerms:
    """The :class:`PlanTerms` of ``plan`` (shared by the plans equal in :func:`terms_key`)."""
    pp, vp = plan.pipeline_parallel, plan.virtual_pipeline
    per_layer = _layer_terms(model)  # weights, TP reductions, core attentions, weights reduced over DP
    layers = stage_layers(plan, model)  # [rank][chunk]; virtual stage chunk * pp + rank holds the next layers
    sums = [[[0] * vp for _ in range(pp)] for _ in per_layer]
    first = 0
    for chunk in range(vp):
        for rank in range(pp):
            chosen = slice(first, first + layers[rank][chunk])
            for total, values in zip(sums, per_layer):
                total[rank][chunk] = sum(values[chosen])
            first += layers[rank][chunk]
    stage_weights, stage_reductions, stage_attentions, dp_weights = sums
    comm = CommModel.for_plan(cluster, plan)  # network_efficiency 1: the top of any calibration
    tp = [comm.placement(ParallelGroup.TP, pipeline_rank=r) for r in range(pp)]
    return PlanTerms(
        stage_weights=tuple(map(tuple, stage_weights)), stage_reductions=tuple(map(tuple, stage_reductions)),
        stage_attentions=tuple(map(tuple, stage_attentions)),
        dp_weights=tuple(sum(chunks) // plan.tensor_parallel for chunks in dp_weights),
        tp_bytes_per_ns=tuple(comm.ring_bytes_per_ns(ParallelGroup.TP, pipeline_rank=r) for r in range(pp)),
        tp_step_latency_ns=tuple(0.0 if p.spans_nodes else cluster.intra_node_latency_ns for p in tp),
        dp_size=tuple(comm.placement(ParallelGroup.DP, pipeline_rank=r).size for r in range(pp)),
        dp_bytes_per_ns=tuple(comm.ring_bytes_per_ns(ParallelGroup.DP, pipeline_rank=r) for r in range(pp)))


def iteration_floor_ns(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, cluster: ClusterSpec,
                       terms: PlanTerms | None = None) -> float:
    """A lower bound on the iteration time :func:`~vtrain_plugin.estimate.estimate` gives ``plan``
    on ``cluster`` (see the module doc for why); ``terms``: :func:`plan_terms`, when known."""
    terms = terms or plan_terms(model, plan, cluster)
    work, path = compute_floor_ns(model, plan, training, cluster, terms)
    reduce, gather = dp_floor_ns(model, plan, training, terms)
    return combine_floor_ns(training, work, path, reduce, gather)


def compute_key(model: ModelSpec, training: TrainingSpec) -> tuple:
    """What :func:`compute_floor_ns` reads of ``training``: the GEMM precision, whether TP
    collectives may be hidden or narrower, the global batch."""
    hidden = training.tp_comm_overlap or training.fp8 is not None or training.fp4 is not None
    return gemm_precision(model.dtype.value, training)[0], hidden, training.global_batch_size


def compute_floor_ns(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, cluster: ClusterSpec,
                     terms: PlanTerms) -> tuple[tuple[float, ...], float]:
    """Per pipeline rank, its ``m`` micro-batches' compute and TP collectives, and the critical
    path's to the last rank's end (see the module doc); reads ``plan``'s :func:`terms_key`, micro-batch
    size and recompute, and ``training``'s :func:`compute_key`."""
    pp, tp = plan.pipeline_parallel, plan.tensor_parallel
    tokens = plan.micro_batch_size * model.seq_length  # one micro-batch of one replica
    peak = _peak(cluster.gpu, gemm_precision(model.dtype.value, training)[0])
    per_flop_ns = 1.0 / (peak * _top(cluster.gpu, "gemm_efficiency") * tp * plan.context_parallel)
    passes = 1 + (plan.recompute is Recompute.FULL)  # full recompute runs each layer's forward twice
    layer_per_weight = (passes * FORWARD_FLOPS_PER_WEIGHT + BACKWARD_FLOPS_PER_WEIGHT) * tokens * per_flop_ns
    reduction_ns = [(passes + 1) * ns for ns in _tp_reduction_ns(model, plan, training, terms)]
    attention_ns = _core_attention_ns(model, plan, peak, cluster.gpu)
    stage_ns = [[w * layer_per_weight + n * reduction_ns[rank] + a * attention_ns for w, n, a in zip(*per_chunk)]
                for rank, per_chunk in enumerate(zip(terms.stage_weights, terms.stage_reductions,
                                                     terms.stage_attentions))]
    m = training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
    work = [m * sum(chunks) for chunks in stage_ns]  # one micro-batch's forward, recompute and backward, m times
    # the output layer, never recomputed
    work[-1] += m * model.hidden_size * model.vocab_size * (FORWARD_FLOPS_PER_WEIGHT + BACKWARD_FLOPS_PER_WEIGHT
                                                           ) * tokens * per_flop_ns
    path = sum(stage_ns[rank][0] for rank in range(pp - 1)) + work[-1]  # the last rank's compute
    return tuple(work), path


def combine_floor_ns(training: TrainingSpec, work: Sequence[float], path: float, reduce: Sequence[float],
                     gather: Sequence[float]) -> float:
    """The iteration floor from :func:`compute_floor_ns` and :func:`dp_floor_ns`: the busiest
    stream, with the reductions after the compute under ``grad_reduce: after_backward`` and the
    parameter gathers after the step without ``overlap_param_gather``."""
    tail = reduce if training.grad_reduce is GradReduce.AFTER_BACKWARD else (0.0,) * len(work)
    overlapped = training.overlap_param_gather  # the gathers open the iteration on the DP stream, else follow the step
    compute = max(*(w + t for w, t in zip(work, tail)), path + tail[-1],
                  *(r + g * overlapped for r, g in zip(reduce, gather)))
    return compute + (0.0 if overlapped else max(gather))


@lru_cache(maxsize=64)
def _peak(gpu: str, precision: str) -> float:
    return get_device(gpu).tensor_flop_per_ns(precision)


@lru_cache(maxsize=64)
def _top(gpu: str, constant: str) -> float:
    """The top of ``constant``'s calibrated range on ``gpu``."""
    return constant_range(constant, gpu)[1]


def _core_attention_ns(model: ModelSpec, plan: ParallelPlan, peak_flop_per_ns: float, gpu: str) -> float:
    """One layer's core attention of one micro-batch on one TP rank, every pass, at least (0 with
    a sliding window, whose kernels score fewer pairs, or CP, which splits the pairs unevenly)."""
    if model.window_size is not None or plan.context_parallel > 1:
        return 0.0
    modules = plan.recompute_modules or ("core_attn",)
    again = plan.recompute is Recompute.FULL or (plan.recompute is Recompute.SELECTIVE and "core_attn" in modules)
    forward_per_pair = attention_terms(model)[1] / FORWARD_BACKWARD  # FLOPs per (sequence, query, key), causal
    forward = forward_per_pair * plan.micro_batch_size * model.seq_length ** 2 / plan.tensor_parallel
    rate = peak_flop_per_ns * max(_top(gpu, "gemm_efficiency"), _top(gpu, "attention_efficiency"))
    return (1 + again + ATTENTION_BACKWARD_PER_FORWARD) * forward / rate


def _tp_reduction_ns(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, terms: PlanTerms
                     ) -> tuple[float, ...]:
    """Per pipeline rank, one block's TP reduction of one micro-batch's ``tokens x h`` tensor in one
    pass (0 where it may be hidden or narrower): see the module doc."""
    n = plan.tensor_parallel
    if n == 1 or training.tp_comm_overlap or training.fp8 is not None or training.fp4 is not None:
        return (0.0,) * plan.pipeline_parallel
    nbytes = plan.micro_batch_size * model.seq_length // plan.context_parallel * model.hidden_size * (
        canonical_dtype(model.dtype.value).nbytes)
    return tuple(2 * (n - 1) * (nbytes / n / rate + latency)
                 for rate, latency in zip(terms.tp_bytes_per_ns, terms.tp_step_latency_ns))


def dp_key(model: ModelSpec, training: TrainingSpec) -> tuple:
    """What :func:`dp_floor_ns` reads of ``training``: FSDP, the distributed optimizer, the gradient
    dtype, FP8 parameter gathers."""
    return (training.fsdp is not None, training.distributed_optimizer, training.grad_dtype(model.dtype),
            training.fp8_param_gather)


def dp_floor_ns(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, terms: PlanTerms
                ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per pipeline rank, its gradient reductions and its parameter all-gathers over its DP group,
    at least (see the module doc); reads ``plan``'s :func:`terms_key` and ``training``'s :func:`dp_key`."""
    pp = plan.pipeline_parallel
    sharded = training.distributed_optimizer
    if training.fsdp is not None or (sharded and plan.distributed_optimizer_instances > 1):
        return (0.0,) * pp, (0.0,) * pp
    per_weight_byte_ns = [w * (n - 1) / n / rate for w, n, rate in zip(terms.dp_weights, terms.dp_size,
                                                                       terms.dp_bytes_per_ns)]
    grad_nbytes = training.grad_dtype(model.dtype).nbytes
    if not sharded:
        return tuple(2 * grad_nbytes * ns for ns in per_weight_byte_ns), (0.0,) * pp
    param_nbytes = Dtype.FP8.nbytes if training.fp8_param_gather else canonical_dtype(model.dtype.value).nbytes
    return tuple(grad_nbytes * ns for ns in per_weight_byte_ns), tuple(param_nbytes * ns for ns in per_weight_byte_ns)
