"""A plan search costs each chunk role once for every plan that folds it to other layer counts (PP,
VP), and its rows stay the one-plan estimates of the same plans, exactly, for dense and MoE models."""

import importlib
from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import clear_cache, trace
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.evaluate import evaluate, evaluate_batch, make_batches, plan_row
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import Candidate, SearchSpace
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec
from benchmarks.speed.search_equality import plan_of

DENSE = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
MOE = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                seq_length=128, vocab_size=1024, dtype="bf16", num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=192)
CLUSTER = get_cluster_preset("dgx-a100")
PREPARE = importlib.import_module("vtrain_plugin.cost.prepare")  # the module: the package exports its function
EVALUATE = importlib.import_module("vtrain_plugin.planning.evaluate")
STACK_MEMORY = importlib.import_module("vtrain_plugin.cost.stack_memory")
COSTING = importlib.import_module("vtrain_plugin.cost.costing")
ARRAY_ENGINE = importlib.import_module("vtrain_plugin.sim.array_engine")


def clear_costing_caches() -> None:
    """Every in-process cache an estimate reads, so the next estimate is computed from nothing."""
    clear_cache()
    for cache in (PREPARE._roles, PREPARE._mapped_nodes, PREPARE._bodies, PREPARE._steps, STACK_MEMORY._deltas,
                  STACK_MEMORY._memories, COSTING._role_times, COSTING._role_messages, ARRAY_ENGINE._results):
        cache.clear()


def test_plans_that_fold_one_trace_to_other_layer_counts_share_its_lowered_kernels():
    # PP 2 and PP 4 of 8 layers: the first and last stages are the same traced roles, 4 and 2 layers each
    two, four = (trace(DENSE, ParallelPlan(tensor_parallel=2, pipeline_parallel=pp)) for pp in (2, 4))
    prepared_two, prepared_four = prepare(two, "megatron_deepspeed_2023"), prepare(four, "megatron_deepspeed_2023")
    for first, last in ((prepared_two.stages[0], prepared_four.stages[0]),
                        (prepared_two.stages[-1], prepared_four.stages[-1])):
        assert first.role.kernels is last.role.kernels and first.role.nodes is last.role.nodes
        assert {s.count for s in first.role.segments} != {s.count for s in last.role.segments}
    training = TrainingSpec(global_batch_size=16)
    shared = [estimate(g, cluster=CLUSTER, training=training) for g in (two, four)]
    PREPARE._roles.clear()
    alone = [estimate(g, cluster=CLUSTER, training=training) for g in (four, two)][::-1]
    assert shared == alone


@pytest.mark.parametrize("model,space", [
    (DENSE, SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2, 4), micro_batch_size=(1, 2),
                        sequence_parallel=(False,), recompute=("none", "full"), grad_reduce=("overlap",))),
    (MOE, SearchSpace(tensor_parallel=(1,), pipeline_parallel=(1, 2), micro_batch_size=(1, 2),
                      sequence_parallel=(False,), recompute=("none",), grad_reduce=("overlap",))),
], ids=["dense", "moe"])
def test_sampled_search_rows_equal_one_plan_estimates(model, space, tmp_path, monkeypatch):
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path))
    clear_cache()
    result = search(model, cluster=CLUSTER, global_batch_size=16, gpus="8", space=space, workers=2)
    rows = result.table.to_dict("records")
    assert len(rows) >= 8, len(rows)
    clear_cache()
    PREPARE._roles.clear()
    for row in rows[::max(1, len(rows) // 8)]:
        plan, training = plan_of(row, TrainingSpec(global_batch_size=16))  # as a plan file gives it
        est = estimate(trace(model, plan), cluster=CLUSTER, training=training)
        for column in ("iteration_time_ms", "tokens_per_second", "tflops_per_gpu", "mfu", "peak_memory_gib",
                       "cost_usd", "num_microbatches", "fits_in_memory"):
            assert row[column] == getattr(est, column), column


def test_a_batch_prepares_each_graph_once_per_training_options(monkeypatch):
    # one parallel plan, gradient reduction x distributed optimizer: two prepared graphs (the optimizer
    # is sharded or not), each costed twice; every row the one-plan estimate with no cache warm
    plan = ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    candidates = tuple(Candidate(parallel=plan, training=TrainingSpec(global_batch_size=16, grad_reduce=reduce,
                                                                      distributed_optimizer=sharded))
                       for reduce in ("overlap", "after_backward") for sharded in (False, True))
    (batch,) = make_batches(DENSE, CLUSTER, candidates, profile_db=False)
    prepared = []
    monkeypatch.setattr(EVALUATE, "prepare_run", lambda *a: prepared.append(a) or PREPARE.prepare_run(*a))
    rows = evaluate_batch(batch)
    assert len(prepared) == 2 and [p for p, _ in rows] == [0, 1, 2, 3]
    for position, row in rows:
        clear_costing_caches()
        assert row == plan_row(candidates[position], evaluate(DENSE, candidates[position], CLUSTER, profile_db=False))


def test_plans_of_one_shape_time_its_roles_once_and_share_what_they_do_not_change():
    # PP 2 and PP 4 of one traced shape on 8 GPUs: their first (and last) stages fold one role to 4
    # and 2 layers, timed once; the two gradient reductions of one plan share its memory. Every
    # estimate equals the one made with no cache warm.
    two, four = (trace(DENSE, ParallelPlan(tensor_parallel=2, pipeline_parallel=pp, data_parallel=8 // (2 * pp)))
                 for pp in (2, 4))
    clear_costing_caches()
    timed = []
    original = COSTING._time_role
    monkey = pytest.MonkeyPatch()
    monkey.setattr(COSTING, "_time_role", lambda *a: timed.append(a[0]) or original(*a))
    trainings = [TrainingSpec(global_batch_size=16, grad_reduce=reduce) for reduce in ("overlap", "after_backward")]
    try:
        shared = [estimate(g, cluster=CLUSTER, training=t, profile_db=False) for g in (two, four) for t in trainings]
    finally:
        monkey.undo()
    roles = {id(role.kernels) for role in timed}
    assert len(timed) == len(roles) == 3, "each lowered role (first, middle, last) timed once for all four plans"
    assert shared[0].memory_gib is shared[1].memory_gib and shared[2].memory_gib is shared[3].memory_gib
    for (graph, training), est in zip([(g, t) for g in (two, four) for t in trainings], shared):
        clear_costing_caches()
        assert est == estimate(graph, cluster=CLUSTER, training=training, profile_db=False)


def _costed_alone(prepared, est_training, cluster=CLUSTER):
    """Each stage's work costed by itself, with nothing shared between stages."""
    from vtrain_plugin.cost.comm.collectives import CommModel
    from vtrain_plugin.cost.kernels.timer import KernelTimer
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device

    plan = prepared.graph.parallel
    device = get_device(cluster.gpu)
    constants = calibration_for(device.name, prepared.stack).constants
    comm = CommModel.for_plan(cluster, plan, network_efficiency=constants.network_efficiency,
                              model=prepared.graph.model)
    timer = KernelTimer(device, constants)
    m = est_training.num_microbatches(plan.data_parallel, plan.micro_batch_size)
    costing = COSTING.cost(prepared, timer=timer, comm=comm, training=est_training, num_microbatches=m)
    alone = [COSTING._stage_cost(s, timer, comm, est_training, m, False, COSTING._ep_overlap(plan, timer),
                                 COSTING._offload_nbytes(prepared, s, est_training), prepared.graph.model, plan,
                                 prepared.stack)
             for s in prepared.stages]
    return costing, alone, comm.rank_classes()


@pytest.mark.parametrize("model,plan", [
    (DENSE, ParallelPlan(tensor_parallel=2, pipeline_parallel=4, virtual_pipeline=2, data_parallel=2)),
    (replace(MOE, num_layers=8), ParallelPlan(pipeline_parallel=4, virtual_pipeline=2, data_parallel=2,
                                              expert_parallel=2, overlap_moe_expert_parallel_comm=True)),
], ids=["dense", "moe-ep-overlap"])
def test_stages_of_one_role_are_assembled_prepared_and_costed_once(model, plan):
    # the middle chunks of a plan share their blocks, their prepared role and runtime collectives and,
    # where their ranks time collectives alike, their stage cost; each stage's work is what costing it
    # alone gives (with the EP overlap, whose merged pairs depend on the rank, each rank its own)
    graph = trace(model, plan)
    middle = [s for s in graph.stages if not s.has_embedding and not s.has_head]
    assert len(middle) == 6 and len({id(s.blocks) for s in middle if s.chunk == 0}) == 1
    training = TrainingSpec(global_batch_size=16)
    prepared = prepare(graph, "megatron_core_te")
    alike = [s for s in prepared.stages if s.stage in middle and s.stage.chunk == 0]
    assert all(s.role is alike[0].role and s.runtime is alike[0].runtime for s in alike)
    costing, alone, classes = _costed_alone(prepared, training)
    assert list(costing.work.chunks) == [s.work for s in alone]
    works = {id(costing.work.chunks[i]) for i, s in enumerate(prepared.stages) if s in alike}
    ranks = {s.stage.pipeline_rank if plan.overlap_moe_expert_parallel_comm else classes[s.stage.pipeline_rank]
             for s in alike}
    assert len(works) == len(ranks) and (len(ranks) < len(alike)) != plan.overlap_moe_expert_parallel_comm


def _role_fields(role) -> tuple:
    """Every field of a prepared role, arrays as lists (NaN as None), to compare roles made apart."""
    def plain(a):
        return [None if x != x else x for x in a.tolist()]
    kernels = role.kernels
    return (role.blocks, role.nodes, role.comm_rows, role.segments, role.flops, plain(role.measured_ns),
            plain(role.module_calls), plain(role.layer_calls),
            *(plain(getattr(kernels, name)) for name in ("kind", "dtype", "flops", "nbytes", "batch", "m", "n", "k",
                                                         "backward", "launches")))


def test_optimizer_shardings_lay_out_each_blocks_other_phases_once(monkeypatch):
    # with and without the distributed optimizer (its step on 1 of 4 shards): each block's forward,
    # backward and recompute rows are laid out once, its optimizer step per sharding; every role is
    # the one lowered with no cache warm
    graph = trace(DENSE, ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=4, recompute="full"))
    clear_costing_caches()
    laid_out = []
    original = PREPARE._piece
    monkeypatch.setattr(PREPARE, "_piece", lambda block, mapped, phases, moe: laid_out.append(phases)
                        or original(block, mapped, phases, moe))
    plain, sharded = (prepare(graph, "megatron_core_te", distributed_optimizer=d) for d in (False, True))
    # blocks of equal traced nodes (a trace read from the disk cache hands them out as one tuple) and
    # parameters are one block to lay out; the optimizer step reads the nodes and the kind alone
    blocks = [b for s in plain.stages[:1] + plain.stages[-1:] for b in s.role.blocks]
    bodies, steps = {PREPARE._lowered_by(b) for b in blocks}, {(id(b.nodes), b.kind) for b in blocks}
    assert laid_out.count(PREPARE._BODY_PHASES) == len(bodies)
    assert laid_out.count((Phase.OPTIMIZER,)) == 2 * len(steps)
    for prepared, shards in ((plain, False), (sharded, True)):
        for stage in prepared.stages:
            PREPARE._roles.clear()
            PREPARE._bodies.clear()
            PREPARE._steps.clear()
            PREPARE._mapped_nodes.clear()
            alone = prepare(graph, "megatron_core_te", distributed_optimizer=shards)
            (same,) = [s for s in alone.stages if s.stage == stage.stage]
            assert _role_fields(stage.role) == _role_fields(same.role)
    assert _role_fields(plain.stages[0].role) != _role_fields(sharded.stages[0].role)
