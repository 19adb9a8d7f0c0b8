"""best_first(): costs plans lowest floor first and stops once the next floor exceeds the top_k-th best
fitting value; a value below its floor makes it cost every plan. plan_floors(): the per-plan floors, each
term computed once per distinct input."""

from dataclasses import replace

import numpy as np
import pytest

from vtrain_plugin.core.units import NS_PER_MS, NS_PER_S, SECONDS_PER_DAY, SECONDS_PER_HOUR
from vtrain_plugin.cost.time_floor import iteration_floor_ns
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning import bounded
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec


def _evaluator(values, fits, costed):
    def evaluate(positions):
        costed.extend(positions)
        return [(p, {"t": values[p], "fits_in_memory": fits[p]}) for p in positions]
    return evaluate


def test_stops_at_the_first_floor_above_the_kth_best_fitting_value(monkeypatch):
    monkeypatch.setattr(bounded, "FIRST_ROUND_PLANS", 2)
    floors = np.array([5.0, 1.0, 2.0, 3.0, 4.0, 2.5, 9.0])
    values = [6.0, 1.5, 2.5, 3.5, 4.5, 3.0, 9.5]
    fits = [True, False, True, True, True, True, True]  # the lowest floor does not fit: it sets no cutoff
    costed = []
    done = bounded.best_first(floors, _evaluator(values, fits, costed), column="t", top_k=1)
    # a round of 2 (floors 1, 2: best 2.5), then of the next 4 only the floor equal to the cutoff (a
    # plan there could tie); the next floor, 3, exceeds it
    assert costed == [1, 2, 5]
    assert [p for p, _ in done] == costed


def test_a_value_below_its_floor_costs_every_plan(monkeypatch):
    monkeypatch.setattr(bounded, "FIRST_ROUND_PLANS", 2)
    floors = np.array([1.0, 2.0, 3.0, 4.0])
    values = [0.5, 2.5, 3.5, 4.5]  # plan 0 breaks its floor
    costed = []
    bounded.best_first(floors, _evaluator(values, [True] * 4, costed), column="t", top_k=1)
    assert sorted(costed) == [0, 1, 2, 3]


# A MoE model (EP, routed and shared experts) and a dense GPT in fp16 over a grid of every axis the
# floor reads (TP, CP, PP, VP, DP, EP, micro-batch, recompute, gradient reduction, distributed
# optimizer, FP8 with TransformerEngine), under base training specs that differ in what only the
# DP terms read (gradients in bf16, FP8 parameter gathers).
MOE = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                seq_length=256, vocab_size=1024, dtype="bf16", num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=256, moe_shared_expert_intermediate_size=256)
DENSE_FP16 = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=1024)
GRID = SearchSpace(context_parallel=(1, 2), software_stack=("megatron_core_local", "megatron_core_te"),
                   fp8=("off", "hybrid"))


@pytest.mark.parametrize("model", [MOE, DENSE_FP16], ids=["moe-bf16", "gpt-fp16"])
def test_plan_floors_are_the_per_plan_floors(model):
    cluster = get_cluster_preset("dgx-h100")
    candidates = []
    fp8_gathers = dict(software_stack="megatron_core_te", fp8="hybrid", fp8_param_gather=True)
    for options, space in (({}, GRID), ({"grad_reduce_in_bf16": True}, GRID),
                           (fp8_gathers, replace(GRID, software_stack=None, fp8=None))):
        base = TrainingSpec(global_batch_size=16, total_tokens=1e9, **options)
        candidates += enumerate_plans(model, space, global_batch_size=16, budget=GpuBudget.parse("16"),
                                      training=base, gpus_per_node=8).candidates
    assert len({c.parallel.context_parallel for c in candidates}) == 2 and len(candidates) > 5000, len(candidates)
    floors_ns = [iteration_floor_ns(model, c.parallel, c.training, cluster) for c in candidates]
    assert bounded.plan_floors(model, candidates, cluster, "iteration_time_ms").tolist() == [
        ns / NS_PER_MS for ns in floors_ns]
    days = [ns / NS_PER_S * c.training.train_iterations(model.seq_length) / SECONDS_PER_DAY
            for ns, c in zip(floors_ns, candidates)]
    assert bounded.plan_floors(model, candidates, cluster, "expected_train_days").tolist() == days
    for column, iterations in (("cost_usd", False), ("train_cost_usd", True)):
        dollars = [ns / NS_PER_S * (c.training.train_iterations(model.seq_length) if iterations else 1) * c.num_gpus
                   / SECONDS_PER_HOUR * cluster.price_per_gpu_hour_usd for ns, c in zip(floors_ns, candidates)]
        assert bounded.plan_floors(model, candidates, cluster, column).tolist() == dollars, column
