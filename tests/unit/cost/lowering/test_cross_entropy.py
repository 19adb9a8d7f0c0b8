"""Megatron-core's fused cross entropy on a small real GPT traced on the fake process group: one
fp32 copy of the logits more at the loss's peak than the unfused loss the trace runs."""

from __future__ import annotations

import pytest

from vtrain_plugin.core.graph import BlockKind
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.lowering.cross_entropy import deferred_wgrad_nbytes, fused_cross_entropy_forward_nbytes
from vtrain_plugin.cost.memory import all_held
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

S, MB, TP, VOCAB, H = 32, 2, 2, 256, 64
LOGITS = S * MB * VOCAB // TP  # logits of one micro-batch on one TP rank


@pytest.fixture(scope="module")
def gpt():
    from vtrain_plugin.capture.tracer import trace

    return trace(ModelSpec(family="gpt", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S,
                           vocab_size=VOCAB, dtype="bf16"),
                 ParallelPlan(tensor_parallel=TP, pipeline_parallel=2, micro_batch_size=MB))


def test_the_loss_holds_one_more_fp32_copy_of_the_logits(gpt):
    head = next(b for b in gpt.stages[-1].blocks if b.kind is BlockKind.HEAD)
    assert fused_cross_entropy_forward_nbytes(head.nodes, 2) == (2 + 4) * LOGITS
    assert fused_cross_entropy_forward_nbytes(gpt.stages[0].layer_template().nodes, 2) == 0


@pytest.mark.parametrize("stack", list(SoftwareStack))
def test_only_the_stage_of_the_loss_peaks_higher(gpt, stack):
    def memory(fusion: bool):
        training = TrainingSpec(global_batch_size=8, cross_entropy_fusion=fusion)
        return stack_rank_memory(gpt, all_held, stack, training)

    fused, unfused = memory(True), memory(False)
    assert fused[0] == unfused[0]
    assert (fused[1].activations_gib - unfused[1].activations_gib) * GIB == pytest.approx(4 * LOGITS, abs=1e-6)


@pytest.mark.parametrize(("limit", "held"), [(0, 3), (2, 2), (9, 3)])
def test_deferred_output_layer_wgrad_keeps_earlier_micro_batches(gpt, limit, held):
    """4 micro-batches; at the last one's backward the earlier deferred ones' bf16 logits gradients
    and output-layer inputs (s x b x h in bf16) are still held."""
    head = next(b for b in gpt.stages[-1].blocks if b.kind is BlockKind.HEAD)
    assert deferred_wgrad_nbytes(head, 2, 4, limit) == held * (2 * LOGITS + 2 * S * MB * H)
    assert deferred_wgrad_nbytes(gpt.stages[0].layer_template(), 2, 4, limit) == 0

    def memory(defer: bool):
        training = TrainingSpec(global_batch_size=4 * MB, defer_embedding_wgrad=defer, wgrad_deferral_limit=limit)
        return stack_rank_memory(gpt, all_held, SoftwareStack.MEGATRON_CORE_TE,
                                 training)

    deferred, plain = memory(True), memory(False)
    assert deferred[0] == plain[0]
    assert (deferred[1].activations_gib - plain[1].activations_gib) * GIB == pytest.approx(
        held * (2 * LOGITS + 2 * S * MB * H), abs=1e-6)



@pytest.mark.parametrize("backward_extra", [0, 64 * LOGITS])
def test_the_fused_forward_and_the_backward_peak_are_two_moments(gpt, backward_extra):
    """The fused cross entropy's forward (the model-dtype logits and the compiled fp32 buffer beside
    the stash) and the backward's peak (the logits' gradient, TE's unfused attention) are not
    simultaneous: the larger counts, not their sum."""
    from vtrain_plugin.cost.memory import rank_memory

    stage = gpt.stages[-1]
    head = next(b for b in stage.blocks if b.kind is BlockKind.HEAD)
    forward = fused_cross_entropy_forward_nbytes(head.nodes, 2)
    assert stage.blocks[-1] is head  # the extra at the head's backward, the first moment
    memory = rank_memory(gpt, all_held, backward_peaks=True, forward_extra=lambda s: forward,
                         block_extra=lambda s: [0] * (len(s.blocks) - 1) + [backward_extra])[-1]
    backward = stage.held_nbytes + stage.backward_peak_nbytes + backward_extra
    assert memory.activations_gib * GIB == stage.activation_nbytes + max(backward, stage.held_nbytes + forward)
    assert (backward > stage.held_nbytes + forward) == bool(backward_extra)  # each moment is the peak once
