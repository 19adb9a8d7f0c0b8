"""Chunk traces derived at other micro-batch sizes from two traced ones equal the direct traces, op by
op (dense layers; MoE chunks are refused and traced); a search traces its shapes before it evaluates,
deriving micro-batch sizes, and its rows equal the one-plan estimates of directly traced plans."""

import json
import os

import pytest

from vtrain_plugin.capture import child_trace, disk_cache, tracer
from vtrain_plugin.capture.chunk import shape_key
from vtrain_plugin.capture.megatron_chunk import trace_chunk
from vtrain_plugin.capture.rescale import PROBES, rescale
from vtrain_plugin.capture.tracer import clear_cache, prepare_traces, trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.evaluate import evaluate
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec
from benchmarks.speed.search_equality import plan_of

DENSE = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
LLAMA = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  seq_length=128, vocab_size=1024, dtype="bf16")
MOE = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                seq_length=128, vocab_size=1024, dtype="bf16", num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=192)
CLUSTER = get_cluster_preset("dgx-a100")

CASES = [  # (model, plan, pre_process, post_process, layers built)
    (DENSE, ParallelPlan(tensor_parallel=2, pipeline_parallel=2), True, False, 2),
    (DENSE, ParallelPlan(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True, recompute="full"),
     False, True, 2),
    (LLAMA, ParallelPlan(tensor_parallel=2, sequence_parallel=True, recompute="selective"), True, True, 2),
]


@pytest.mark.parametrize("model,plan,pre,post,built", CASES, ids=["gpt-embedding", "gpt-head-sp-full",
                                                                  "llama-selective"])
def test_a_trace_derived_at_another_micro_batch_size_is_the_direct_trace_op_by_op(model, plan, pre, post, built):
    def traced(b):
        return trace_chunk(model, ParallelPlan(**{**plan.to_dict(), "micro_batch_size": b}), pre, post, built)

    low, high = (traced(b) for b in PROBES)
    assert rescale(low, high, 1) is None  # some ops launch nothing on size-1 dimensions: traced
    for b in (4, 7):
        derived, direct = rescale(low, high, b), traced(b)
        assert derived is not None
        assert len(derived.blocks) == len(direct.blocks)
        for ours, theirs in zip(derived.blocks, direct.blocks):
            assert len(ours.nodes) == len(theirs.nodes), ours.name
            for i, (a, c) in enumerate(zip(ours.nodes, theirs.nodes)):
                assert a == c, (b, ours.name, i)
            assert ours == theirs
        assert derived.to_dict() == direct.to_dict()


def test_a_moe_chunk_is_not_derived_its_router_loss_scale_is_not_affine():
    # the auxiliary loss is scaled by 1 / tokens: a float argument that differs between the sizes
    plan = ParallelPlan(tensor_parallel=2, sequence_parallel=True, data_parallel=2, expert_parallel=2)
    low, high = (trace_chunk(MOE, ParallelPlan(**{**plan.to_dict(), "micro_batch_size": b}), True, True, 1)
                 for b in PROBES)
    assert rescale(low, high, 4) is None


def test_two_traces_that_differ_in_more_than_sizes_derive_nothing():
    one = trace_chunk(DENSE, ParallelPlan(micro_batch_size=2), True, True, 1)
    other = trace_chunk(DENSE, ParallelPlan(micro_batch_size=3, recompute="full"), True, True, 1)
    assert rescale(one, other, 5) is None


def test_prepared_traces_are_the_direct_ones_and_evaluating_then_traces_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path))
    clear_cache()
    training = TrainingSpec(global_batch_size=16)
    space = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2,), micro_batch_size=(1, 2, 4, 8),
                        sequence_parallel=(True,), recompute=("none",), grad_reduce=("after_backward",))
    candidates = enumerate_plans(DENSE, space, global_batch_size=16, budget=GpuBudget.parse("4,8"),
                                 training=training, gpus_per_node=8).candidates
    assert {c.parallel.micro_batch_size for c in candidates} == {1, 2, 4, 8}
    calls, traced = [], {}
    real = child_trace.trace_chunks

    def tracing(model, plan, roles):
        calls.append(plan.micro_batch_size)
        chunks = real(model, plan, roles)
        traced.update((shape_key(model, plan, *role), chunk) for role, chunk in zip(roles, chunks, strict=True))
        return chunks

    monkeypatch.setattr(child_trace, "trace_chunks", tracing)
    prepare_traces(DENSE, [c.parallel for c in candidates])
    assert sorted(set(calls)) == [1, *PROBES]  # sizes 4 and 8 derived, 1 traced
    clear_cache()
    calls.clear()
    prepared = [evaluate(DENSE, c, CLUSTER) for c in candidates]
    assert calls == []  # every shape read from the cache
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")
    clear_cache()
    for key, chunk in traced.items():  # the direct traces above, in memory: no trace from the disk cache
        tracer._remember(key, chunk)
    for candidate, est in zip(candidates, prepared):
        assert est == estimate(trace(DENSE, candidate.parallel), cluster=CLUSTER, training=candidate.training)
    assert sorted(set(calls)) == [4, 8]  # the derived sizes, traced directly here


def test_a_cold_search_traces_in_its_workers_and_its_rows_equal_one_plan_estimates(tmp_path, monkeypatch):
    # The parent may not trace: its trace_chunks raises. The workers (forked from it, or fresh
    # interpreters) trace (and derive micro-batch sizes) into the shared cache, then estimate from it;
    # each row equals the estimate of its plan traced directly, at its own micro-batch size: traced
    # here, or by a forked worker (the roles it traced, not derived, are listed in ``direct``).
    space = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1, 2, 4, 8),
                        recompute=("full",), grad_reduce=("overlap",))
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path / "search"))
    clear_cache()
    parent, traces = os.getpid(), child_trace.trace_chunks
    direct = tmp_path / "direct.jsonl"

    def no_trace(model, plan, roles):  # a forked worker inherits it: there it traces
        if os.getpid() == parent:
            raise AssertionError("the parent traced")
        chunks = traces(model, plan, roles)
        with open(direct, "a", encoding="utf-8") as f:  # one short line per append: whole between workers
            f.writelines(json.dumps([plan.to_dict(), role]) + "\n" for role in roles)
        return chunks

    monkeypatch.setattr(child_trace, "trace_chunks", no_trace)
    candidates = enumerate_plans(LLAMA, space, global_batch_size=8, budget=GpuBudget.parse("4"),
                                 training=TrainingSpec(global_batch_size=8), gpus_per_node=8).candidates
    jobs = tracer.trace_jobs(LLAMA, [c.parallel for c in candidates])
    assert len(jobs) > 2 and any(job.derives for job in jobs)
    result = search(LLAMA, cluster=CLUSTER, global_batch_size=8, gpus="4", space=space, workers=2)
    assert tracer.trace_jobs(LLAMA, [c.parallel for c in candidates]) == []  # every role in the disk cache
    traced = {}  # the workers' direct traces, read back from the cache before it is turned off
    for plan, (pre, post, built) in map(json.loads, direct.read_text(encoding="utf-8").splitlines()
                                        if direct.exists() else []):
        key = shape_key(LLAMA, ParallelPlan(**plan), pre, post, tuple(built) if isinstance(built, list) else built)
        traced[key] = disk_cache.load(key)
        assert traced[key] is not None, key
    monkeypatch.setattr(child_trace, "trace_chunks", traces)
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")
    clear_cache()
    for key, chunk in traced.items():
        tracer._remember(key, chunk)
    assert len(result.table) >= 10
    for row in result.table.to_dict("records"):
        plan, training = plan_of(row, TrainingSpec(global_batch_size=8))  # as a plan file gives it
        est = estimate(trace(LLAMA, plan), cluster=CLUSTER, training=training)
        assert (row["iteration_time_ms"], row["peak_memory_gib"]) == (est.iteration_time_ms, est.peak_memory_gib)
