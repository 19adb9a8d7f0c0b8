"""What an estimate takes for granted rather than traces: one line each, listed with every estimate.

Each source below reads the model and the plan and says what vtrain assumed or costed other than by
tracing megatron-core's own model (a routing assumption, a kernel priced by a lowering rule, a
stand-in); :func:`assumptions` concatenates them, and the estimate lists them in its JSON and in
the footer of its table. A feature that assumes something adds a source here.

Why a list of its own: a user comparing the estimate with a measured run needs to know which of
its numbers rest on an assumption the run may break (skewed routing, dropped tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from vtrain_plugin.specs.model import SINKHORN_ITERATIONS, LoadBalancing, ModelSpec
from vtrain_plugin.specs.optimizer import OptimizerKind
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

Source = Callable[[ModelSpec, ParallelPlan], tuple[str, ...]]


def moe_assumptions(model: ModelSpec, plan: ParallelPlan) -> tuple[str, ...]:
    """The routing assumption of a MoE model, and its features costed rather than traced."""
    if not model.is_moe:
        return ()
    topk, experts = model.router_topk, model.num_experts
    if model.moe_routing_skew == 1.0:
        routing = (f"MoE routing balanced: every expert receives tokens x {topk} / {experts} of each rank's tokens "
                   f"(the router's real choices are data)")
    else:
        routing = (f"MoE routing skewed: the busiest expert receives {model.moe_routing_skew:g} x the balanced share "
                   f"and sets the layer's pace; MFU counts balanced routing")
    if model.moe_router_load_balancing_type is LoadBalancing.SINKHORN:
        balancing = (f"MoE router sinkhorn: {SINKHORN_ITERATIONS} iterations per layer and step traced by a stand-in "
                     f"(megatron-core iterates to a tolerance, which is data: 2-12 measured on random logits); the "
                     f"host read of each iteration's check not priced")
    else:
        per = {LoadBalancing.SEQ_AUX_LOSS: " per sequence", LoadBalancing.GLOBAL_AUX_LOSS: " over the global batch"
               }.get(model.moe_router_load_balancing_type, "")
        balancing = f"MoE router load balancing traced as the auxiliary loss{per} (coefficient 0.01)"
    lines = [routing, balancing]
    if model.moe_expert_capacity_factor is not None:
        lines.append(f"MoE capacity factor {model.moe_expert_capacity_factor:g} under balanced routing: each expert "
                     f"computes min(balanced share, capacity) tokens"
                     + (", padded to the capacity" if model.moe_pad_expert_input_to_capacity else ""))
    if model.moe_grouped_gemm:
        lines.append("MoE grouped GEMM: the traced per-expert kernels (SequentialMLP) priced as one grouped kernel "
                     "per GEMM (TEGroupedMLP)")
    if model.moe_permute_fusion:
        lines.append("MoE permute fusion: the traced unfused permutation, chunk sort and unpermutation priced as "
                     "TE's fused kernels, one each way")
    if model.moe_router_fusion:
        lines.append("MoE router fusion: the traced top-k, scores and auxiliary loss priced as TE's fused router "
                     "kernels")
    if model.moe_shared_expert_overlap:
        lines.append("MoE shared expert overlap: the forward dispatch and combine all-to-alls hidden behind the "
                     "shared expert's GEMMs")
    return tuple(lines) + moe_comm_assumptions(model, plan)


def moe_comm_assumptions(model: ModelSpec, plan: ParallelPlan) -> tuple[str, ...]:
    """The flex dispatcher's stand-in and constants, and the EP all-to-all overlap's step model."""
    lines = []
    if plan.moe_token_dispatcher.value == "flex":
        lines.append(f"MoE flex dispatcher ({plan.moe_flex_dispatcher_backend.value}) traced as one all-to-all per "
                     f"dispatch / combine of each token once per destination rank under balanced routing; timed "
                     f"at the fractions of nominal NVLink and NIC rates DeepEP measured on H800, not validated on "
                     f"other GPUs"
                     + ("; HybridEP priced with DeepEP's bandwidths" if plan.moe_flex_dispatcher_backend.value
                        == "hybridep" else ""))
    if plan.overlap_moe_expert_parallel_comm:
        sms = (f"compute beside them loses the {plan.flex_num_sms} SMs of the flex kernels"
               if plan.moe_token_dispatcher.value == "flex" else "NCCL's SMs not counted")
        lines.append("EP all-to-all overlap: steady-state forward/backward pairs merged in megatron-core's four "
                     "steps, dispatch and combine each half of a phase's EP time" +
                     (", expert weight gradients half of their backward GEMM time" if plan.delay_wgrad_compute
                      else "") + f"; {sms}")
    return tuple(lines)


def attention_assumptions(model: ModelSpec, plan: ParallelPlan) -> tuple[str, ...]:
    """The attention variants that megatron-core cannot build on a CPU without a stand-in, and the
    kernel counts vtrain assumes for them (megatron_adapters/stand_ins.py)."""
    lines = []
    if model.multi_latent_attention:
        lines.append("MLA traced through a core-attention stand-in with TransformerEngine's signature; its fused "
                     "attention priced over the query/key and value head dims (not measured)")
    if model.window_size is not None:
        lines.append(f"sliding window {model.window_size[0]} tokens back: the fused kernel priced at exactly the "
                     f"in-window scores (the real kernel computes whole tiles); its mask built on the CPU by a "
                     f"stand-in")
    if model.softmax_type == "learnable":
        lines.append("attention sinks: one learned logit per head, no GEMM work, the sinks read and their "
                     "gradient written")
    if model.mtp_num_layers is not None:
        lines.append(f"multi-token prediction: {model.mtp_num_layers} MTP layer(s) on the last pipeline stage; its "
                     f"embedding copy is not gradient-synchronised with the first stage's")
    return tuple(lines)


def hybrid_assumptions(model: ModelSpec, plan: ParallelPlan) -> tuple[str, ...]:
    """A Mamba hybrid's mixer: a stand-in traced, its kernels modelled from their math."""
    if not model.is_hybrid:
        return ()
    return ("Mamba-2 mixer traced through a stand-in of megatron-core's MambaMixer (mamba_ssm needs CUDA); "
            "its causal-conv1d, chunked-scan and gated-norm kernels priced from their math, never measured",)


SOURCES: tuple[Source, ...] = (moe_assumptions, attention_assumptions, hybrid_assumptions)


def training_assumptions(training: TrainingSpec) -> tuple[str, ...]:
    """What FSDP, deterministic mode and the optimizer are priced with rather than measured."""
    lines = list(training.fsdp.assumptions()) if training.fsdp else []
    if training.deterministic:
        lines.append("deterministic mode: NCCL pinned to the ring algorithm (NCCL_ALGO=Ring); TE's deterministic "
                     "attention backward priced at 1.1 x the fused one (a bound of [1.0, 1.2] from its ordered dQ "
                     "accumulation, not validated on any GPU); embedding and MoE unpermute backward as traced")
    if training.optimizer.kind is OptimizerKind.MUON:
        lines.append(f"Muon: {training.optimizer.muon_ns_steps} Newton-Schulz steps in bf16 on each 2-D layer "
                     f"weight, TP shards all-gathered in fp32 (duplicated mode), QKV orthogonalised as one matrix; "
                     f"priced from the GEMM model, not measured")
    if training.unfused_attention:
        lines.append("unfused attention: score and context GEMMs as traced, Megatron's fused masked softmax and "
                     "dropout kernels")
    # TE's attention ignores masked_softmax_fusion (vtrain_plugin.specs.megatron.fusion_flags)
    unfused = [name for name in training.unfused_kernels
               if not (name == "masked_softmax" and training.software_stack is SoftwareStack.MEGATRON_CORE_TE)]
    if unfused:
        lines.append(f"Megatron's fusions off ({', '.join(unfused)}): those ops run unfused, one "
                     f"kernel per op of megatron-core's eager code as traced on the CPU (the dropout as one "
                     f"native_dropout); not measured")
    if training.activation_offload is not None:
        lines.append(f"activation offloading ({training.activation_offload.label}): copies run at the device's "
                     f"host-link bandwidth per direction (datasheets: PCIe Gen5 x16 64 GB/s on H100/H200, "
                     f"Gen4 32 GB/s on A100, NVLink-C2C 450 GB/s on GB200), or at the GPU's share of the node's CPU "
                     f"memory bandwidth with every GPU copying both ways (DGX H100: 614 GB/s / 16) where lower; "
                     f"achieved copies are lower still, not validated; offloads beyond each layer's forward compute "
                     f"are exposed, reloads beyond the backward between two offload groups; the size floor is "
                     f"applied per module, not per tensor")
    if training.log_params_norm or training.log_num_zeros_in_grad:
        lines.append("per-step logging (--log-params-norm / --log-num-zeros-in-grad): one multi-tensor read of 4 bytes "
                     "per local fp32 parameter each, timed as the gradient-norm pass; their scalar all-reduces and "
                     "count_zeros' per-tensor launches are not priced (not validated on any GPU)")
    if not training.nan_checks:
        lines.append("no NaN checks (--no-check-for-nan-in-loss-and-grad): no gradient-bucket norms and no host reads "
                     "of the loss and the norms; the fitted host costs come from runs with the checks on")
    if training.per_token_loss:
        lines.append("per-token loss: the token count broadcast over PP and all-reduced over DP x CP, one host read "
                     "and a scaling pass over every local gradient per step; no loss divisions per micro-batch")
    if training.manual_gc:
        lines.append("manual garbage collection: the automatic collector's share of host time (0.1%, measured on the "
                     "CPU) out of the steps, a full collection (0.2 s of CPU, measured on a small process) every "
                     f"{training.manual_gc_interval} steps" if training.manual_gc_interval else
                     "manual garbage collection: the automatic collector's share of host time (0.1%, measured on the "
                     "CPU) out of the steps, no collection during training (--manual-gc-interval 0)")
    return tuple(lines)


def assumptions(model: ModelSpec | None, plan: ParallelPlan) -> tuple[str, ...]:
    """Every source's lines for ``model`` under ``plan`` (none for a plain module without a ModelSpec)."""
    if model is None:
        return ()
    return tuple(line for source in SOURCES for line in source(model, plan))
