"""The EP all-to-all overlap of megatron-core's combined 1F1B (``overlap_moe_expert_parallel_comm``)
and its delayed weight gradients (``delay_wgrad_compute``), as a saving on a chunk's work.

In the steady phase, megatron-core runs the forward of one micro-batch and the backward of another
as one merged task, layer by layer, in four steps whose communication (on its own stream) runs
beside the other micro-batch's compute (``combined_1f1b``, ``fine_grained_callables``):

    step 1: backward combine all-to-all   beside  forward attention
    step 2: forward dispatch all-to-all   beside  backward MoE MLP (data gradients; weight gradients too
                                                  unless delayed)
    step 3: backward dispatch all-to-all  beside  forward MoE MLP (+ the delayed expert weight gradients)
    step 4: forward combine all-to-all    beside  backward attention

Each step takes ``max(comm, compute + share * comm)``: compute runs on the SMs the communication
kernels leave (``share``: the flex dispatcher's ``num_sms / sm_count``; 0 for NCCL, whose SMs are not
counted). A merged pair saves the sum of its parts minus the four steps. Dispatch and combine carry
the same tokens, so each takes half of a phase's exposed EP time; the experts' weight-gradient GEMMs
take half of their backward GEMM time (a data- and a weight-gradient GEMM of equal FLOPs per
linear). Warm-up and cool-down tasks are not merged: the saving applies to the steady pairs, spread
over every task of the chunk (:func:`steady_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapParts:
    """One micro-batch through one chunk, split as the merged steps need it (ns)."""

    forward_other_ns: float  # attention and everything outside the MoE MLPs
    forward_moe_ns: float  # the MoE MLPs' compute (router, permutation, experts)
    backward_other_ns: float
    backward_moe_ns: float
    backward_expert_gemm_ns: float  # the experts' GEMMs among backward_moe_ns
    ep_forward_ns: float  # exposed dispatch + combine of the forward
    ep_backward_ns: float


def merged_pair_ns(parts: OverlapParts, *, delay_wgrad: bool, comm_sm_share: float) -> float:
    """The four steps of one merged forward-backward pair (see the module doc)."""
    wgrad = parts.backward_expert_gemm_ns / 2 if delay_wgrad else 0.0
    f_comm, b_comm = parts.ep_forward_ns / 2, parts.ep_backward_ns / 2

    def step(comm: float, compute: float) -> float:
        return max(comm, compute + comm_sm_share * comm)

    return (step(b_comm, parts.forward_other_ns) + step(f_comm, parts.backward_moe_ns - wgrad)
            + step(b_comm, parts.forward_moe_ns + wgrad) + step(f_comm, parts.backward_other_ns))


def pair_saving_ns(parts: OverlapParts, *, delay_wgrad: bool, comm_sm_share: float) -> float:
    alone = (parts.forward_other_ns + parts.forward_moe_ns + parts.backward_other_ns + parts.backward_moe_ns
             + parts.ep_forward_ns + parts.ep_backward_ns)
    return max(0.0, alone - merged_pair_ns(parts, delay_wgrad=delay_wgrad, comm_sm_share=comm_sm_share))


def steady_pairs(*, pipeline_parallel: int, virtual_pipeline: int, num_microbatches: int, pipeline_rank: int) -> float:
    """Share of a rank's forward (and backward) tasks that megatron-core merges: all but the warm-up
    forwards of the interleaved schedule, ``(pp - rank - 1) * 2 + (vp - 1) * pp`` (its
    ``num_warmup_microbatches``), of ``m * vp``; without pipelining, all but the first forward."""
    tasks = num_microbatches * virtual_pipeline
    if pipeline_parallel == 1:
        warmup = 1
    else:
        warmup = (pipeline_parallel - pipeline_rank - 1) * 2 + (virtual_pipeline - 1) * pipeline_parallel
    return max(0, tasks - min(warmup, tasks)) / tasks
