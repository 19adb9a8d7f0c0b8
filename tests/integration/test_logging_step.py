"""Per-step logging priced, not free: --log-params-norm and --log-num-zeros-in-grad each add one read
of the rank's fp32 parameters / gradients to the optimizer step of a traced megatron-core GPT
(exact bytes, with and without the distributed optimizer), more time each, and the real CLI."""

import json

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.cost.prepare import prepare_run
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

MODEL = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, dtype="bf16")


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, ParallelPlan(data_parallel=2))


def _optimizer_nbytes(graph, training):
    prepared = prepare_run(graph, "megatron_core_te", training)
    role = prepared.stages[0].role
    return sum(n.nbytes * role.blocks[s.block].count for s in role.segments if s.phase is Phase.OPTIMIZER
               for n in role.nodes[s.start:s.stop] if n is not None)


@pytest.mark.parametrize("distributed", [False, True])
def test_each_flag_adds_a_read_of_four_bytes_per_local_parameter(graph, distributed):
    params = sum(b.count * b.num_parameters for b in graph.stages[0].blocks)  # one rank, TP 1
    local = params // 2 if distributed else params  # the distributed optimizer shards over DP 2
    base = TrainingSpec(global_batch_size=4, distributed_optimizer=distributed)
    plain = _optimizer_nbytes(graph, base)
    for fields, reads in ((dict(log_params_norm=True), 1), (dict(log_num_zeros_in_grad=True), 1),
                          (dict(log_params_norm=True, log_num_zeros_in_grad=True), 2)):
        added = _optimizer_nbytes(graph, TrainingSpec(global_batch_size=4, distributed_optimizer=distributed,
                                                      **fields)) - plain
        assert added == pytest.approx(reads * 4 * local, rel=2e-3)  # shards padded by megatron-core


def test_each_flag_adds_time_and_is_stated(graph):
    cluster = get_cluster_preset("dgx-h100")
    times = {}
    for name, fields in (("none", {}), ("norm", dict(log_params_norm=True)), ("zeros", dict(log_num_zeros_in_grad=True)),
                         ("both", dict(log_params_norm=True, log_num_zeros_in_grad=True))):
        est = estimate(graph, cluster=cluster, training=TrainingSpec(global_batch_size=4, **fields))
        times[name] = est.iteration_time_ms
        assert any("per-step logging" in line for line in est.assumptions) == bool(fields)
    assert times["none"] < times["norm"] < times["both"] and times["none"] < times["zeros"] < times["both"]


def test_cli_estimates_a_plan_that_logs_norms(tmp_path, run_cli):
    plan = {"model": MODEL.to_dict(), "parallel": {"data_parallel": 2},
            "training": {"global_batch_size": 4, "log_params_norm": True, "log_num_zeros_in_grad": True},
            "cluster": {"preset": "dgx-h100"}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    proc = run_cli("estimate", str(path), "--format", "json", check=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["iteration_time_ms"] > 0
