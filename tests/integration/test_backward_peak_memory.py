"""What a traced step holds beside its saved activations and what its backward adds at its peak
(vtrain_plugin.capture.live_memory), on real megatron-core models, and the peak allocated it gives
against the H100 ground truth (benchmarks/results/h100_validation.csv, torch.cuda.max_memory_allocated)."""


import pandas as pd
import pytest

from benchmarks.device.h100_validation import GROUND_TRUTH_CSVS, on_lent_gpu
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

S, B, A = 128, 2, 8
GROUND_TRUTH = pd.read_csv(GROUND_TRUTH_CSVS["h100-sxm"]).set_index("plan")


def _stage(family: str, recompute: str):
    model = ModelSpec(family=family, num_layers=2, hidden_size=256, num_attention_heads=A, seq_length=S,
                      vocab_size=1000, dtype="bf16")
    return trace(model, ParallelPlan(micro_batch_size=B, recompute=recompute)).stages[0]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_step_holds_megatrons_global_score_buffer(recompute):
    """The local attention's baddbmm writes into megatron-core's global memory buffer (b * heads
    x s x s in bf16), which lives through the step and no saved tensor counts; beside it the step
    holds the per-token fp32 losses and two fp32 scalars."""
    stage = _stage("gpt", recompute)
    assert stage.held_nbytes == B * A * S * S * 2 + B * S * 4 + 2 * 4


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_outside_the_core_attention_the_step_holds_the_losses_and_the_logits_gradient(recompute):
    """What a fused attention kernel's step holds (TransformerEngine): the same measure without what
    the local core attention allocates. No score buffer is held; without full recompute the backward
    peaks at the gradient of the bf16 logits (s x b x padded vocabulary 1024), with selective
    recompute too (the rebuilt scores were the core attention's)."""
    stage = _stage("gpt", recompute)
    assert stage.held_outside_attention_nbytes == B * S * 4 + 2 * 4
    if recompute == "full":  # a layer's activations rebuilt, less its attention's score-sized tensors
        assert S * B * 1024 * 2 < stage.backward_peak_outside_attention_nbytes < stage.backward_peak_nbytes
    else:
        assert stage.backward_peak_outside_attention_nbytes == S * B * 1024 * 2


def test_full_recompute_rebuilds_a_whole_layer_during_its_backward():
    """Under full recompute a layer keeps only its input, but its backward runs its forward again
    and holds everything the layer saves without recompute: the backward rises by at least that,
    less the head's activations freed before it."""
    none, full = _stage("gpt", "none"), _stage("gpt", "full")
    layer = none.layer_template().activation_nbytes
    head = next(b for b in none.blocks if b.kind.value == "head").activation_nbytes
    assert full.layer_template().activation_nbytes < layer / 30
    assert full.backward_peak_nbytes >= layer - head
    assert none.backward_peak_nbytes < full.backward_peak_nbytes


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_gpus_softmax_backward_adds_a_temporary_of_its_output(recompute):
    """torch's softmax backward on a GPU computes ``grad * output`` apart (seen on an H200): with it
    a recomputed attention's backward peaks higher, by at most one fp32 score-sized tensor; a fused
    attention's measure leaves it out with the rest of the core attention."""
    stage = _stage("gpt", recompute)
    scores = B * A * S * S * 4
    assert stage.backward_peak_nbytes < stage.gpu_softmax_backward_peak_nbytes <= stage.backward_peak_nbytes + scores


@pytest.mark.parametrize("plan", ["llama-1b_mb2_full", "gpt-350m_mb8_full", "llama-1b_mb2_selective"])
def test_peak_allocated_of_recompute_against_the_h100(plan):
    """Plans trained on a lent H100 with recompute (their peak inside a recomputed attention's
    backward): within 5% of max allocated with bf16 gradients, fused norms and the softmax
    backward's temporary counted."""
    predicted = estimate(on_lent_gpu(plan, "h100-sxm"), profile_db=False).peak_allocated_gib
    measured = GROUND_TRUTH.loc[plan, "measured_peak_gib"]
    assert abs(predicted / measured - 1) < 0.05
