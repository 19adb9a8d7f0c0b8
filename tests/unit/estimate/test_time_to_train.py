"""Time and cost to train N tokens: ``training.total_tokens``, the iteration count it rounds up to,
and the days, GPU-hours and dollars an estimate derives from it (exact arithmetic)."""

import json
import math

import pytest

from vtrain_plugin.runs import load_run_config
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.cost.memory import RankMemory
from vtrain_plugin.estimate import Estimate
from vtrain_plugin.specs.plan_file import parse_plan
from vtrain_plugin.specs.reading import read_mapping
from vtrain_plugin.specs.training import TrainingSpec

PLAN = """
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 128}
parallel: {micro_batch_size: 1}
training: {global_batch_size: 8, total_tokens: TOKENS}
"""


def test_total_tokens_is_optional_and_kept_as_a_float():
    assert TrainingSpec(global_batch_size=8).total_tokens is None
    spec = TrainingSpec(global_batch_size=8, total_tokens=270_000_000_000)
    assert spec.total_tokens == 2.7e11 and isinstance(spec.total_tokens, float)
    assert TrainingSpec(global_batch_size=8, total_tokens=270e9).to_dict()["total_tokens"] == 2.7e11


@pytest.mark.parametrize("value,message", [
    (-1, "training.total_tokens must be positive and finite, got -1"),
    (0, "training.total_tokens must be positive and finite, got 0"),
    (float("nan"), "training.total_tokens must be positive and finite, got nan"),
    (float("inf"), "training.total_tokens must be positive and finite, got inf"),
    (10**400, "training.total_tokens must be positive and finite, got 10**400"),
    ("270e9", "training.total_tokens must be a positive number, got '270e9'"),
    (True, "training.total_tokens must be a positive number, got True"),
])
def test_bad_total_tokens_is_one_line_naming_the_field(value, message):
    with pytest.raises(ConfigError) as exc:
        TrainingSpec(global_batch_size=8, total_tokens=value)
    assert str(exc.value) == message


def test_iterations_round_up_to_whole_global_batches():
    tokens_per_iteration = 1536 * 2048
    assert TrainingSpec(global_batch_size=1536).train_iterations(2048) is None
    assert TrainingSpec(global_batch_size=1536, total_tokens=300e9).train_iterations(2048) == 95368
    exact = TrainingSpec(global_batch_size=1536, total_tokens=3 * tokens_per_iteration)
    assert exact.train_iterations(2048) == 3
    one_more = TrainingSpec(global_batch_size=1536, total_tokens=3 * tokens_per_iteration + 1)
    assert one_more.train_iterations(2048) == 4
    assert TrainingSpec(global_batch_size=1536, total_tokens=1).train_iterations(2048) == 1


@pytest.mark.parametrize("written", ["270e9", "2.7e11", "270000000000", "2.7e+11", "270_000_000_000"])
def test_plan_files_take_total_tokens_as_written(tmp_path, written):
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN.replace("TOKENS", written))
    assert parse_plan(read_mapping(path)).training.total_tokens == 2.7e11


def test_json_plan_files_take_total_tokens_too(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128},'
                    ' "parallel": {"micro_batch_size": 1},'
                    ' "training": {"global_batch_size": 8, "total_tokens": 270e9}}')
    assert parse_plan(read_mapping(path)).training.total_tokens == 2.7e11


def test_a_bad_total_tokens_in_a_plan_file_names_the_file_and_field(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN.replace("TOKENS", "-1e9"))
    with pytest.raises(ConfigError) as exc:
        load_run_config(path)
    assert str(exc.value) == f"{path}: training.total_tokens must be positive and finite, got -1000000000.0"


def test_vtrain_configs_have_no_token_count(tmp_path):
    """The seed project's config describes one iteration; a run length is given with --tokens."""
    path = tmp_path / "vtrain.json"
    path.write_text(json.dumps({
        "num_gpus": 1, "tensor_parallel_size": 1, "data_parallel_size": 1, "pipeline_parallel_size": 1,
        "global_batch_size": 8, "micro_batch_size": 1, "num_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "max_length": 128, "total_tokens": 1e9}))
    with pytest.raises(ConfigError, match="vTrain config: unknown key 'total_tokens'"):
        load_run_config(path)


def _estimate(*, iterations, cost_usd, total_tokens=None):
    memory = RankMemory(weights_gib=1.0, gradients_gib=1.0, optimizer_gib=6.0, activations_gib=2.0,
                        inflight_microbatches=1)
    return Estimate(iteration_time_ms=3_600_000.0, breakdown_ms={}, stage_breakdown_ms=(), num_gpus=8,
                    num_microbatches=1, global_batch_size=8, tokens_per_second=1.0, tflops_per_gpu=1.0,
                    hardware_tflops_per_gpu=1.0, mfu=0.5, gpu="a100-sxm4-80gb", software_stack="local_spec", cost_usd=cost_usd,
                    measured_fraction=0.0, memory_gib=(memory,), gpu_memory_gib=80.0, total_tokens=total_tokens,
                    iterations=iterations)


def test_days_gpu_hours_and_dollars_of_the_run():
    # one hour per iteration on 8 GPUs at $2 per GPU-hour: $16 per iteration
    e = _estimate(iterations=48, cost_usd=16.0, total_tokens=48 * 8 * 1024.0)
    assert e.train_days == 2.0
    assert e.train_gpu_hours == 384.0
    assert e.train_cost_usd == 768.0 == e.train_gpu_hours * 2.0
    d = e.to_dict()
    assert (d["total_tokens"], d["iterations"], d["train_days"], d["train_gpu_hours"], d["train_cost_usd"]) == (
        393216.0, 48, 2.0, 384.0, 768.0)


def test_no_price_means_no_dollars_and_no_tokens_means_no_run():
    assert _estimate(iterations=48, cost_usd=None, total_tokens=1.0).train_cost_usd is None
    e = _estimate(iterations=None, cost_usd=16.0)
    assert (e.train_days, e.train_gpu_hours, e.train_cost_usd) == (None, None, None)
    d = e.to_dict()
    assert all(d[k] is None for k in ("total_tokens", "iterations", "train_days", "train_gpu_hours",
                                      "train_cost_usd"))


def test_the_iterations_of_an_estimate_come_from_its_training_spec():
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.hardware.clusters import get_cluster_preset
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan

    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=512)
    graph = trace(model, ParallelPlan(micro_batch_size=2))
    training = TrainingSpec(global_batch_size=8, total_tokens=1e6)
    e = estimate(graph, cluster=get_cluster_preset("dgx-a100"), training=training)
    assert e.total_tokens == 1e6 and e.iterations == math.ceil(1e6 / (8 * 128)) == 977
    assert e.train_days == 977 * e.iteration_time_ms / 1e3 / 86400.0
    assert e.train_gpu_hours == 977 * e.iteration_time_ms / 1e3 * 1 / 3600.0
    assert e.train_cost_usd == 977 * e.cost_usd
