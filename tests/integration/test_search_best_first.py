"""Best-first search: the iteration-time floor never exceeds an estimate, and the search that stops at
the floor finds the very rows the exhaustive search ranks first, for every objective `size` and
`search --top` use."""

from dataclasses import replace

import pytest
import yaml

from vtrain_plugin.cli import main
from vtrain_plugin.cost.time_floor import iteration_floor_ns
from vtrain_plugin.planning.evaluate import evaluate
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.sizing import size_model
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

from vtrain_plugin.planning import bounded

from test_search_pruning import CLUSTER, DENSE, HYBRID

# Wide enough that the weight GEMMs the floor counts are a third to two thirds of an iteration: a
# floor that counted a GEMM twice would show here, not in the kernel overheads of a tiny model.
WIDE_FIELDS = dict(family="llama", num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                   seq_length=2048, vocab_size=32000, dtype="bf16")
WIDE = ModelSpec(**WIDE_FIELDS)
WIDE_MOE = replace(WIDE, hidden_size=2048, num_attention_heads=16, num_query_groups=4, num_experts=8,
                   moe_router_topk=2, moe_ffn_hidden_size=2048)
WIDE_HYBRID = replace(HYBRID, hidden_size=2048, num_attention_heads=16, seq_length=2048)
# Every axis the floor reads: TP (with and without SP), PP (with and without VP: 1F1B and interleaved),
# DP through the GPU count and the micro-batches, recompute (full recomputes the GEMMs), EP for MoE.
# Selective recompute reruns no GEMM: its floor is the one without recompute, checked there.
FLOOR_SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2, 4), micro_batch_size=(1,),
                          recompute=("none", "full"), grad_reduce=("after_backward",), distributed_optimizer=(False,))
# Small enough to cost exhaustively beside the best-first search, with plans that tie (the gradient
# reduction does not show without data parallelism).
SEARCH_SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1, 4),
                           virtual_pipeline=(1,), sequence_parallel=(False,), recompute=("none", "full"),
                           grad_reduce=("after_backward", "overlap"), distributed_optimizer=(False,))


# A dense GPT in fp16 is the llama's arithmetic at the same peak: the llama stands for both.
@pytest.mark.parametrize("model", [WIDE, WIDE_MOE, WIDE_HYBRID], ids=["llama-bf16", "moe-bf16", "hybrid-bf16"])
def test_the_floor_is_below_the_estimate_of_every_plan(model):
    space = replace(FLOOR_SPACE, expert_parallel=(1, 4)) if model.is_moe else FLOOR_SPACE  # EP 2, 8: more of the same
    candidates = _floors_below_estimates(model, space, "8")
    assert len(candidates) >= 12, len(candidates)
    assert model.is_hybrid or any(c.parallel.virtual_pipeline > 1 for c in candidates)


def _floors_below_estimates(model, space, gpus):
    """The plans of ``space`` on ``gpus`` GPUs (16 sequences per iteration), each checked: 0 < floor <= estimate."""
    candidates = enumerate_plans(model, space, global_batch_size=16, budget=GpuBudget.parse(gpus),
                                 training=TrainingSpec(global_batch_size=16), gpus_per_node=8).candidates
    for candidate in candidates:
        floor_ms = iteration_floor_ns(model, candidate.parallel, candidate.training, CLUSTER) / 1e6
        estimate_ms = evaluate(model, candidate, CLUSTER).iteration_time_ms
        assert 0 < floor_ms <= estimate_ms, (candidate.parallel, candidate.training)
    return candidates


# TP 1 and 2 (its collectives count on the compute stream), DP 16 over two nodes or 8 in one, each way
# of reducing the gradients the floor reads: all-reduce after the backward or overlapped, reduce-scatter
# and parameter all-gather of the distributed optimizer.
DP_SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1,), micro_batch_size=(1,), sequence_parallel=(False,),
                       recompute=("none",), grad_reduce=("after_backward", "overlap"), distributed_optimizer=(False, True))


def test_the_floor_with_the_gradient_reduction_is_below_the_estimate():
    assert len(_floors_below_estimates(WIDE, DP_SPACE, "16")) == 8


# TransformerEngine's kernels (fused attention at its own efficiency, userbuffers off) under every
# recompute mode, with and without SP, and the distributed optimizer's overlapped gathers.
TE_SPACE = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(1,), micro_batch_size=(1,),
                       recompute=("none", "selective", "full"), software_stack=("megatron_core_te",),
                       grad_reduce=("overlap",), distributed_optimizer=(True,))


def test_the_floor_is_below_the_estimate_under_transformer_engine():
    assert len(_floors_below_estimates(WIDE, TE_SPACE, "8")) == 6


def test_a_floor_counts_the_weight_gemms_at_peak():
    # PP 1, TP 1, 4 micro-batches of 2 x 128 tokens: 4 layers of h (3h + h) + 2 h 4h weights, 256 x 1024 logits,
    # 6 FLOPs per weight and token without recompute, 8 with full recompute, at the A100's GEMM ceiling
    # (267.9 of its 312 TFLOP/s).
    training = TrainingSpec(global_batch_size=8)
    weights = 4 * (4 * 256 * 256 + 2 * 256 * 1024) + 256 * 1024
    tokens = 8 * 128
    for recompute, flops in (("none", 6), ("full", 8)):
        plan = enumerate_plans(DENSE, replace(FLOOR_SPACE, tensor_parallel=(1,), pipeline_parallel=(1,),
                                              recompute=(recompute,), sequence_parallel=(False,)),
                               global_batch_size=8, budget=GpuBudget.parse("1"), training=training,
                               gpus_per_node=8).candidates[0].parallel
        gemms = (flops * tokens * weights - (flops - 6) * tokens * 256 * 1024) / 267.9e3
        # core attention: 2 s^2 h causal FLOPs per sequence and layer forward, in forward, recompute and
        # twice in backward, at 0.9 of the peak (the attention efficiency's top)
        attention = (flops // 2) * 4 * 8 * 2 * 128**2 * 256 / (312e3 * 0.9)
        expected = gemms + attention
        assert iteration_floor_ns(DENSE, plan, training, CLUSTER) == pytest.approx(expected, rel=1e-12)


def _best_rows(result, k):
    return result.table.head(k).drop(columns=["pareto"]).to_dict("records")


@pytest.mark.parametrize("objective,tokens", [("time", None), ("days", 3e8), ("cost", 3e8), ("cost", None)],
                         ids=["iteration-time", "days-to-train", "cost-to-train", "cost-per-iteration"])
@pytest.mark.parametrize("model", [WIDE], ids=["llama-bf16"])  # the stop rule reads floors, not layer kinds
def test_best_first_finds_the_exhaustive_searchs_best_rows(model, objective, tokens, monkeypatch):
    monkeypatch.setattr(bounded, "FIRST_ROUND_PLANS", 4)  # rounds of 4, 8, 16, ... plans: the floor can stop one
    kwargs = dict(cluster=CLUSTER, global_batch_size=16, gpus="1:8", space=SEARCH_SPACE, objective=objective,
                  tokens=tokens, workers=1)
    everything = search(model, **kwargs)
    best = search(model, **kwargs, top_k=3, exhaustive=False)
    assert everything.num_fitting > 3 and len(everything.table) == everything.num_candidates
    # The floor prunes the plans on more GPUs than the fastest needs; by cost (GPUs x time) it may prune none.
    assert len(best.table) < len(everything.table) or objective == "cost", "the floor pruned nothing"
    assert _best_rows(best, 3) == _best_rows(everything, 3)
    assert best.table.iloc[0].to_dict() == everything.table.iloc[0].to_dict()  # the front's fastest: pareto too
    assert best.num_candidates == everything.num_candidates and best.trace_jobs <= everything.trace_jobs


def test_a_search_gives_up_untraced_when_every_floor_exceeds_the_limit():
    kwargs = dict(cluster=CLUSTER, global_batch_size=16, gpus="1:8", space=SEARCH_SPACE, workers=1, top_k=1,
                  exhaustive=False)
    best = search(WIDE, **kwargs)
    lowest = best.lowest_floor
    assert lowest is not None and 0 < lowest <= best.table["iteration_time_ms"].min()
    given_up = search(WIDE, **kwargs, give_up_above=lowest * 0.999)
    assert given_up.table.empty and given_up.trace_jobs == 0 and given_up.lowest_floor == lowest
    at_the_floor = search(WIDE, **kwargs, give_up_above=lowest)  # not above it: searched as without a limit
    assert _best_rows(at_the_floor, 1) == _best_rows(best, 1)


def test_the_cli_prints_the_whole_searchs_first_rows_and_how_many_plans_it_costed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bounded, "FIRST_ROUND_PLANS", 4)
    plan = tmp_path / "wide.yaml"
    plan.write_text(yaml.safe_dump({"model": WIDE_FIELDS, "training": {"global_batch_size": 16},
                                    "cluster": {"preset": CLUSTER.name}}))
    args = ["search", str(plan), "--gpus", "1:8", "--tp", "1,2", "--pp", "1,2", "--micro-batch", "1,4", "--vp", "1",
            "--sp", "off", "--recompute", "none,full", "--grad-reduce", "after_backward,overlap", "--dist-opt", "off",
            "--top", "3", "--workers", "1"]
    assert main(args) == 0
    whole = capsys.readouterr().out.splitlines()
    assert main([*args, "--best-first"]) == 0
    best = capsys.readouterr().out.splitlines()
    assert best[:5] == whole[:5]  # header, rule and the 3 best plans
    costed, candidates = int(best[-1].split()[0].replace(",", "")), int(whole[-1].split()[0].replace(",", ""))
    assert costed < candidates and best[-1].startswith(f"{costed} plans evaluated (best-first, of {candidates}), ")


def test_size_picks_the_plan_the_exhaustive_search_ranks_first():
    # 15M, 40M, 83M and 155M parameters; within 0.004 days: the 83M shape's floors exceed them (0.0049),
    # the 40M shape's do not but its fastest plan does (0.011), the 15M shape trains in 0.0027
    ladder = {"min_params": 5e6, "max_params": 2e8, "hidden_step": 256}
    sized = size_model("gpt", cluster=CLUSTER, gpus="1:8", days=0.004, space=SEARCH_SPACE, workers=1,
                       batch_tokens=2**14, **ladder)
    assert len(sized.evaluated) >= 2
    over_by_floor = 0
    for outcome in sized.evaluated:
        model: ModelSpec = outcome.model
        global_batch = 2**14 // model.seq_length
        everything = search(model, cluster=CLUSTER, global_batch_size=global_batch, gpus="1:8", space=SEARCH_SPACE,
                            training=TrainingSpec(global_batch_size=global_batch), tokens=outcome.tokens, workers=1)
        fastest = everything.table[everything.table["fits_in_memory"]].sort_values("expected_train_days",
                                                                                    kind="stable")
        if outcome.floor_days is None:
            assert outcome.plan == fastest.iloc[0].to_dict()
        else:  # judged over budget by its floors alone: every plan is slower than the floor, itself over budget
            over_by_floor += 1
            assert outcome.plan is None and not outcome.within_budget and outcome.floor_days > 0.004
            assert everything.table["expected_train_days"].min() >= outcome.floor_days
    assert over_by_floor and any(o.plan is not None and not o.within_budget for o in sized.evaluated)
