"""A lower bound on a plan's estimated iteration time from the model's dimensions alone (no trace).

:func:`iteration_floor_ns` counts only the weight GEMMs every traced layer certainly runs, at the
device's dense tensor-core peak, along the pipeline's critical path; :func:`gemm_peak_flop_per_ns`
is the peak both this floor and an estimate's MFU are against.

Why: a search that needs only its best plans (``vtrain size``) orders plans by this floor and stops
costing once the next floor exceeds the best plan found (:mod:`vtrain_plugin.planning.bounded`); a
floor that ever exceeded an estimate would skip a plan that could have won, so every term below is
one the estimator certainly spends, and the terms it cannot prove are left out.

Why it is a lower bound of what :func:`vtrain_plugin.estimate.predict` computes:

- a GEMM's modeled device time is ``max(flops / (peak x efficiency), bytes / bandwidth) +
  overhead`` with ``efficiency = gemm_efficiency x tile fill`` (``cost/kernels/model.py``), both
  factors at most 1 (calibration bounds ``gemm_efficiency`` to [0.5, 0.859]), and the slowest-GPU
  factor is at least 1: so at least ``flops / peak``. The peak is the fastest rate any GEMM of the
  plan may use (FP4 / FP8 with those recipes, else the model dtype's, TF32 for fp32). A *measured*
  kernel faster than the spec-sheet peak would break this; the bounded search checks every
  estimate it makes against its floor and falls back to costing every plan if one ever is below;
- counted: per token and layer ``2 x`` (forward), ``4 x`` (data and weight gradients) and, under
  full recompute, another ``2 x`` the weight elements of the attention projections (MLA's without
  its norms), the dense MLP (2 or 3 GEMMs), a MoE layer's ``topk`` experts plus shared experts
  (dropless only: a capacity factor may drop pairs, so its routed experts are left out), and the
  output layer's ``h x vocab`` (unpadded) on the last stage. Left out, each only adding time: core
  attention (sliding windows, masks), Mamba mixers, multi-token prediction, every memory-bound
  kernel, kernel and host overheads, communication, the optimizer, failures and checkpoints;
- TP, CP, EP and DP divide those FLOPs over the ranks that run them; a MoE layer's traced rank is
  the busiest (or, balanced, at least the mean: the remainder pairs go to the first experts);
- each rank's tasks run one after another on its compute stream (``sim/task_graph.py``: a task ends
  at ``max(previous end, dependency end + send) + duration``), so the iteration is at least the
  busiest rank's ``m`` micro-batches of work, and at least the last rank's work after micro-batch
  0's forward through the first chunk of every earlier rank, followed by the last micro-batch's
  backward back through them (the last task of every rank is its first chunk's last backward).
"""

from __future__ import annotations

from vtrain_plugin.core.dtypes import Dtype, canonical_dtype
from vtrain_plugin.cost.megatron_flops import attention_terms
from vtrain_plugin.hardware.devices import DeviceSpec
from vtrain_plugin.specs import hybrid
from vtrain_plugin.specs.attention import mla_dim
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.pipeline_split import stage_layers
from vtrain_plugin.specs.training import Fp8Recipe, TrainingSpec

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


def layer_weight_elements(model: ModelSpec) -> tuple[int, ...]:
    """Per transformer layer, the weight elements its GEMMs certainly multiply each token by,
    split over TP (and, for routed experts, EP x expert TP): see the module doc."""
    h = model.hidden_size
    gemms = 3 if model.layer.gated_linear_unit else 2
    projections, _ = attention_terms(model)
    if model.multi_latent_attention:  # Megatron's count adds one FLOP per latent element for the norms
        projections -= mla_dim(model, "kv_lora_rank") + (model.q_lora_rank or 0)
    dropless = model.moe_expert_capacity_factor is None
    expert = h * gemms * (model.expert_ffn_size * model.router_topk * dropless
                          + (model.moe_shared_expert_intermediate_size or 0))
    dense = h * gemms * model.ffn_size
    if model.is_hybrid:
        kinds = {hybrid.ATTENTION: projections, hybrid.MLP: dense, hybrid.MOE: expert, hybrid.MAMBA: 0}
        return tuple(kinds[kind] for kind in model.hybrid_layer_pattern)
    return tuple(projections + (expert if moe else dense) for moe in model.moe_layer_pattern)


def iteration_floor_ns(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, device: DeviceSpec) -> float:
    """A lower bound on the iteration time :func:`~vtrain_plugin.estimate.estimate` gives ``plan``
    (see the module doc for why)."""
    pp, vp = plan.pipeline_parallel, plan.virtual_pipeline
    tokens = plan.micro_batch_size * model.seq_length  # one micro-batch of one replica
    per_flop_ns = 1.0 / (gemm_peak_flop_per_ns(device, model.dtype.value, training)
                         * plan.tensor_parallel * plan.context_parallel)
    forward_per_weight = FORWARD_FLOPS_PER_WEIGHT * tokens * per_flop_ns
    layer_per_weight = forward_per_weight * (1 + (plan.recompute is Recompute.FULL)) + (
        BACKWARD_FLOPS_PER_WEIGHT * tokens * per_flop_ns)  # full recompute runs each layer's forward twice
    weights = layer_weight_elements(model)
    layers = stage_layers(plan, model)  # [rank][chunk]; virtual stage chunk * pp + rank holds the next layers
    stage_weights = [[0] * vp for _ in range(pp)]
    first = 0
    for chunk in range(vp):
        for rank in range(pp):
            count = layers[rank][chunk]
            stage_weights[rank][chunk] = sum(weights[first:first + count])
            first += count
    m = training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
    work = [m * sum(chunks) * layer_per_weight for chunks in stage_weights]
    # the output layer, never recomputed
    work[-1] += m * model.hidden_size * model.vocab_size * (FORWARD_FLOPS_PER_WEIGHT + BACKWARD_FLOPS_PER_WEIGHT
                                                           ) * tokens * per_flop_ns
    before_last = sum(stage_weights[rank][0] for rank in range(pp - 1))
    return max(*work, before_last * layer_per_weight + work[-1])
