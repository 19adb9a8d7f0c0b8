"""Megatron-LM's NaN checks, per-token loss and manual GC read from the command line without a
warning, and priced on a traced megatron-core GPT: the checks cost time, --manual-gc-interval adds
its amortised full collection to the optimizer step, each stated among the assumptions."""

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.cost import step_checks
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.flags import TABLE, Effect
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

MODEL = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, dtype="bf16")
BASE = "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 256 --micro-batch-size 2 --vocab-size 1000"


def test_flags_are_read_without_a_warning():
    default = megatron_plan(read_command_line(BASE), gpus=8)
    assert default.training.nan_checks and not default.training.per_token_loss and not default.training.manual_gc
    given = megatron_plan(read_command_line(f"{BASE} --no-check-for-nan-in-loss-and-grad --calculate-per-token-loss "
                                            f"--manual-gc --manual-gc-interval 100 --no-manual-gc-eval"), gpus=8)
    t = given.training
    assert (t.nan_checks, t.per_token_loss, t.manual_gc, t.manual_gc_interval) == (False, True, True, 100)
    assert given.warning is None
    # `vtrain flags` says so; --no-manual-gc-eval collects around evaluation only
    for flag in ("--no-check-for-nan-in-loss-and-grad", "--calculate-per-token-loss", "--manual-gc",
                 "--manual-gc-interval"):
        assert TABLE[flag].effect is Effect.MODELLED
    assert TABLE["--no-manual-gc-eval"].effect is Effect.OUTSIDE_STEP


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, ParallelPlan(data_parallel=2))


def _estimate(graph, **fields):
    return estimate(graph, cluster=get_cluster_preset("dgx-h100"), training=TrainingSpec(global_batch_size=4, **fields))


def test_each_flag_is_priced_and_stated(graph):
    on, off = _estimate(graph), _estimate(graph, nan_checks=False)
    assert off.iteration_time_ms < on.iteration_time_ms
    assert any("no NaN checks" in line for line in off.assumptions)
    assert not any("NaN checks" in line for line in on.assumptions)
    token = _estimate(graph, per_token_loss=True)
    assert token.iteration_time_ms != on.iteration_time_ms and any("per-token loss" in line for line in token.assumptions)
    never = _estimate(graph, manual_gc=True)
    assert never.iteration_time_ms < on.iteration_time_ms  # the automatic collector's share gone
    every = _estimate(graph, manual_gc=True, manual_gc_interval=10)
    host_time_factor = 1.0  # an H100 on its own node
    added = every.stage_breakdown_ms[0]["optimizer"] - never.stage_breakdown_ms[0]["optimizer"]
    assert added == pytest.approx(host_time_factor * step_checks.FULL_COLLECT_NS / 10 / 1e6, rel=1e-6)
    assert any("every 10 steps" in line for line in every.assumptions)
