"""Input limits: the README's table is the code's, and the specs refuse what lies beyond the bounds
(the Python API and the CLI alike) with one line naming the field, before anything is traced."""

import json
import math

import pytest

from tests.conftest import REPO
from vtrain_plugin.runs import load_run_config, run_config_from_dict
from vtrain_plugin.core.checks import show
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.limits import LIMITS, limits_table
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import TrainingSpec

GPT3 = json.loads((REPO / "examples/configs/gpt3_175b_512gpu.json").read_text())
MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128}


def test_the_manual_s_input_limits_table_is_the_code_s():
    inputs = (REPO / "docs" / "inputs.md").read_text()
    assert limits_table() in inputs
    assert len({limit.quantity for limit in LIMITS}) == len(LIMITS)


def _refused(build, message):
    with pytest.raises(ConfigError) as exc:
        build()
    assert str(exc.value) == message
    return exc


@pytest.mark.parametrize("change,message", [
    ({"global_batch_size": 10**12}, "training.global_batch_size must be at most 16,777,216, got 1000000000000"),
    ({"num_layers": 10**30}, "model.num_layers must be at most 10,000, got 10**30"),
    ({"num_gpus": 10**12, "data_parallel_size": 10**12 // 128},
     "data_parallel_size must be at most 1,048,576, got 7812500000"),
    ({"num_gpus": 10**12}, "num_gpus must be at most 1,048,576, got 1000000000000"),
    ({"hidden_size": 10**6}, "model.hidden_size must be at most 262,144, got 1000000"),
    ({"max_length": 2**21}, "model.seq_length must be at most 1,048,576, got 2097152"),
    ({"vocab_size": 10**9}, "model.vocab_size must be at most 4,194,304, got 1000000000"),
    ({"num_attention_heads": 8192}, "model.num_attention_heads must be at most 4,096, got 8192"),
    ({"micro_batch_size": 10**5, "global_batch_size": 4 * 10**5},
     "parallel.micro_batch_size must be at most 65,536, got 100000"),
    ({"max_length": 2**20, "micro_batch_size": 32, "global_batch_size": 128},
     "micro_batch_size (32) * seq_length (1048576) = 33554432 must be at most 16,777,216 (tokens per micro-batch)"),
    ({"global_batch_size": 4 * 300_000},
     "global_batch_size (1200000) / (data_parallel_size (4) * micro_batch_size (1)) = 300000 must be at most "
     "250,000 (micro-batches per iteration)"),
    ({"global_batch_size": 4 * 20_000},
     "num_microbatches (20000) * pipeline_parallel (16) * virtual_pipeline (1) = 320000 must be at most 250,000 "
     "(scheduled passes)"),
    ({"node_size": 10**4}, "node_size must be at most 4,096, got 10000"),
    ({"ddp_bucket_size": math.inf}, "ddp_bucket_size must be at most 1,000,000, got inf"),
    ({"ddp_bucket_size": math.nan}, "ddp_bucket_size must be positive, got nan"),
    ({"inter_node_bandwidth": 1e-9}, "inter_node_bandwidth must lie in [0.001, 10,000,000], got 1e-09"),
    ({"intra_node_bandwidth": math.inf}, "intra_node_bandwidth must lie in [0.001, 1,000,000], got inf"),
])
def test_vtrain_config_beyond_the_limits_is_one_line(change, message):
    _refused(lambda: run_config_from_dict({**GPT3, **change}), message)


def test_vtrain_interleaved_schedule_is_refused_when_the_file_is_read(tmp_path):
    """No tracing first: loading the file, which traces nothing, refuses it."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**GPT3, "pipeline_scheduling": "interleaved"}))
    _refused(lambda: load_run_config(path),
             f"{path}: pipeline_scheduling 'interleaved' needs virtual pipeline stages, which a vTrain config "
             "cannot give; use a plan file with training.schedule interleaved_1f1b and parallel.virtual_pipeline >= 2")


def test_vtrain_ddp_bucket_size_null_means_the_default():
    run = run_config_from_dict({**GPT3, "ddp_bucket_size": None, "use_gradient_bucket": True})
    assert run.training.bucket_size_mb == 40.0  # the seed project's default, not Megatron-Core's
    assert run.training.bucket_nbytes(run.parallel.data_parallel, 2) == 40e6
    assert run_config_from_dict({**GPT3, "ddp_bucket_size": 25}).training.bucket_size_mb == 25.0


@pytest.mark.parametrize("field,value,message", [
    ("price_per_gpu_hour_usd", math.inf, "cluster.price_per_gpu_hour_usd must be at most 10,000, got inf"),
    ("price_per_gpu_hour_usd", 1e5, "cluster.price_per_gpu_hour_usd must be at most 10,000, got 100000.0"),
    ("price_per_gpu_hour_usd", math.nan, "cluster.price_per_gpu_hour_usd must be a non-negative number, got nan"),
    ("inter_node_latency_us", 1e7, "cluster.inter_node_latency_us must be at most 1,000,000, got 10000000.0"),
    ("network_efficiency", 0.001, "cluster.network_efficiency must lie in [0.01, 1], got 0.001"),
    ("gpus_per_node", 10**400, "cluster.gpus_per_node must be at most 4,096, got 10**400"),
])
def test_cluster_beyond_the_limits(field, value, message):
    base = get_cluster_preset("dgx-a100").to_dict()
    _refused(lambda: ClusterSpec(**{**base, field: value}), message)


def test_parallel_plan_world_size_is_bounded_as_a_product():
    _refused(lambda: ParallelPlan(tensor_parallel=1024, pipeline_parallel=1024, data_parallel=2),
             "parallel.tensor_parallel (1024) * context_parallel (1) * pipeline_parallel (1024) * data_parallel (2) "
             "= 2097152 must be at most 1,048,576 (GPUs)")
    _refused(lambda: ParallelPlan(tensor_parallel=8, context_parallel=1024, data_parallel=256),
             "parallel.tensor_parallel (8) * context_parallel (1024) * pipeline_parallel (1) * data_parallel (256) "
             "= 2097152 must be at most 1,048,576 (GPUs)")
    _refused(lambda: ParallelPlan(virtual_pipeline=10**5), "parallel.virtual_pipeline must be at most 10,000, got 100000")


def test_training_total_tokens_and_wrong_types():
    _refused(lambda: TrainingSpec(global_batch_size=8, total_tokens=1e16),
             "training.total_tokens must be at most 1e+15, got 1e+16")
    _refused(lambda: TrainingSpec(global_batch_size=8, schedule=["1f1b"]),
             "training.schedule must be one of gpipe, 1f1b, interleaved_1f1b; got ['1f1b']")
    _refused(lambda: TrainingSpec(global_batch_size=8, bucket_size_mb=10**400),
             "training.bucket_size_mb must be at most 1,000,000, got 10**400")


def test_run_refuses_a_schedule_that_does_not_suit_the_plan_before_tracing():
    model = ModelSpec(**MODEL)
    plan = ParallelPlan(pipeline_parallel=2)
    _refused(lambda: RunConfig(model=model, parallel=plan, cluster=get_cluster_preset("dgx-a100"),
                               training=TrainingSpec(global_batch_size=8, schedule="interleaved_1f1b")),
             "training.schedule interleaved_1f1b requires virtual_pipeline >= 2, got 1")


def test_values_at_the_limits_are_accepted():
    model = ModelSpec(num_layers=10_000, hidden_size=262_144, num_attention_heads=4_096, seq_length=2**20,
                      vocab_size=4_194_304, ffn_hidden_size=2**20)
    plan = ParallelPlan(tensor_parallel=4_096, pipeline_parallel=1, data_parallel=256, micro_batch_size=16)
    training = TrainingSpec(global_batch_size=256 * 16 * 60, total_tokens=1e15, bucket_size_mb=1e6)
    cluster = ClusterSpec(**{**get_cluster_preset("dgx-a100").to_dict(), "gpus_per_node": 4_096,
                             "price_per_gpu_hour_usd": 10_000.0, "network_efficiency": 0.01,
                             "inter_node_bandwidth_gbps": 1e-3, "intra_node_latency_us": 1e6})
    run = RunConfig(model=model, parallel=plan, training=training, cluster=cluster)
    assert run.num_microbatches == 60 and plan.world_size == 2**20


def test_huge_values_are_shown_short_in_messages():
    assert show(10**5000) == "10**5000"
    assert show(-(10**30) - 7) == "-1.000e+30"
    assert show([10**5000, "x" * 100]) == "[10**5000, 'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx']"
    assert show("a\nb") == "'a\\nb'"


def test_search_refuses_budgets_beyond_the_limits_and_skips_plans_beyond_them():
    _refused(lambda: GpuBudget.parse("1:1000000000000"), "gpus must be at most 1,048,576, got 1000000000000")
    model = ModelSpec(**{**MODEL, "seq_length": 2**20, "num_layers": 2})
    enumeration = enumerate_plans(model, SearchSpace(tensor_parallel=(1,), pipeline_parallel=(1,),
                                                     virtual_pipeline=(1,), recompute=("none",),
                                                     grad_reduce=("after_backward",), sequence_parallel=(False,)),
                                  global_batch_size=64, budget=GpuBudget.parse("1"), training=TrainingSpec(
                                      global_batch_size=64), gpus_per_node=8)
    assert [c.parallel.micro_batch_size for c in enumeration.candidates] == [1, 2, 4, 8, 16]
    assert enumeration.skipped == {"micro_batch beyond limits": 2}  # 32 and 64 sequences of 2^20 tokens
