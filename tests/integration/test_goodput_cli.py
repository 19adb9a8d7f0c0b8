"""Failures in the totals of the real CLI: ``--failures off`` gives today's totals exactly, the
expected ones are the API's, ``search --objective days`` ranks by them, and bad values are one
line with exit code 2."""

import json

import pytest

from vtrain_plugin.runs import load_run_config
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import SearchSpace
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

PLAN = """
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 128}
parallel: {micro_batch_size: 1, data_parallel: 2}
training: {global_batch_size: 8}
cluster: {preset: dgx-h100, price_per_gpu_hour_usd: 3.0}
"""
TRAIN_KEYS = ("iterations", "train_days", "train_gpu_hours", "train_cost_usd")


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN)
    return str(path)


def test_failures_off_reproduces_the_failure_free_totals_and_on_adds_the_expected(run_cli, plan):
    on = json.loads(run_cli("estimate", plan, "--tokens", "1e9", "--format", "json", check=True).stdout)
    off = json.loads(run_cli("estimate", plan, "--tokens", "1e9", "--failures", "off", "--format", "json",
                             check=True).stdout)
    assert {k: on[k] for k in TRAIN_KEYS} == {k: off[k] for k in TRAIN_KEYS}
    assert off["expected_train_days"] is None and off["failures"] is None and off["goodput"] is None
    run = load_run_config(plan)
    totals = estimate(run).train_totals(1e9)
    assert on["expected_train_days"] == totals.days
    assert on["expected_train_cost_usd"] == totals.cost_usd
    assert on["failures"]["checkpoint_interval_iterations"] == totals.failures.interval_iterations
    assert on["expected_train_days"] > on["train_days"]
    table = run_cli("estimate", plan, "--tokens", "1e9", "--checkpoint", "async", check=True).stdout
    assert "with failures:" in table and "async checkpoints" in table


@pytest.mark.parametrize("args,message", [
    (("--checkpoint-interval", "0"), "vtrain: error: --checkpoint-interval must be a positive integer of "
                                     "iterations, got '0'"),
    (("--failures", "off", "--checkpoint", "sync"), "--checkpoint and --checkpoint-interval need failures on"),
])
def test_bad_reliability_flags_are_one_line_and_exit_2(run_cli, plan, args, message):
    proc = run_cli("estimate", plan, "--tokens", "1e9", *args)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


def test_a_bad_reliability_section_is_one_line_naming_the_field(run_cli, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(PLAN + "reliability: {failure_rate_per_gpu_hour: -1e-5}\n")
    proc = run_cli("estimate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"vtrain: error: {path}: reliability.failure_rate_per_gpu_hour must be positive, "
                                   f"got -1e-05")


def test_search_ranks_by_the_expected_days_with_failures_on():
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128)
    space = SearchSpace(tensor_parallel=(1,), pipeline_parallel=(1,), micro_batch_size=(1,), virtual_pipeline=(1,),
                        sequence_parallel=(False,), recompute=("none",), grad_reduce=("overlap",),
                        distributed_optimizer=(False,))
    cluster = get_cluster_preset("dgx-h100")
    result = search(model, cluster=cluster, global_batch_size=64, gpus="8,16,32,64", space=space, workers=1,
                    tokens=1e10, objective="days")
    table = result.table
    assert result.time_column == "expected_train_days"
    assert list(table["expected_train_days"]) == sorted(table["expected_train_days"])
    assert (table["expected_train_days"] > table["train_days"]).all()
    assert (table["goodput"] < 1).all()
    off = search(model, cluster=cluster, global_batch_size=64, gpus="8,16,32,64", space=space, workers=1,
                 tokens=1e10, training=TrainingSpec(global_batch_size=64, reliability=None))
    assert off.time_column == "train_days" and "expected_train_days" not in off.table
    assert list(off.table["train_days"]) == sorted(off.table["train_days"])


def test_megatron_args_checkpointing_sets_the_interval_and_async(run_cli):
    flags = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 2 "
             "--vocab-size 1000 --save ckpt --save-interval 50 --async-save")
    result = json.loads(run_cli("estimate", "--megatron-args", flags, "--gpus", "8", "--tokens", "1e8",
                                "--format", "json", check=True).stdout)
    assert result["failures"]["checkpoint"] == "async"
    assert result["failures"]["checkpoint_interval_iterations"] == 50
    assert result["failures"]["checkpoint_interval_chosen"] is False
    assert result["failures"]["checkpoint_interval_clamped_from"] is None


def test_save_interval_longer_than_the_tokens_is_clamped_with_a_note(run_cli):
    # --micro-batch-size 2 on 8 GPUs (DP 8): 16 sequences of 128 tokens per iteration, 2,048 tokens;
    # --tokens 20480 is 10 iterations, shorter than --save-interval 50.
    flags = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 2 "
             "--vocab-size 1000 --save ckpt --save-interval 50")
    text = run_cli("estimate", "--megatron-args", flags, "--gpus", "8", "--tokens", "20480", check=True).stdout
    assert "every 10 iterations (given 50, longer than the run: clamped to its length)" in text
    result = json.loads(run_cli("estimate", "--megatron-args", flags, "--gpus", "8", "--tokens", "20480",
                                "--format", "json", check=True).stdout)
    assert result["failures"]["checkpoint_interval_iterations"] == 10
    assert result["failures"]["checkpoint_interval_clamped_from"] == 50
