"""The plan search's space: budgets, axis values, the plans it enumerates and the exact skip counts."""

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.planning.space import AXES, RULES, GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.training import Fp8Format, GradReduce, ScheduleKind, SoftwareStack, TrainingSpec

# 4 layers, 8 heads (= query groups), FFN 1024, sequence 128
MODEL = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
BASE = TrainingSpec(global_batch_size=1, bucket_size_mb=10.0)


def plans(space, *, gpus="8", global_batch_size=16, training=BASE):
    return enumerate_plans(MODEL, space, global_batch_size=global_batch_size, budget=GpuBudget.parse(gpus),
                           training=training, gpus_per_node=8)


def test_a_fully_pinned_grid_counts_each_combination_once_under_its_first_rule():
    """4 x 3 x 2 x 3 x 2 x 2 = 288 combinations, 2 to 8 GPUs, global batch 8, max_tp 8 (given).

    Combinations that follow an axis value count the pinned values of the later axes:
    after tp 3*2*3*2*2 = 72, after pp 24, after dp 12, after micro-batch 4, after vp 2.

    - tp > max_tp: tp 16                                                  1 x 72 = 72
    - heads % tp: tp 3 (8 % 3)                                            1 x 72 = 72
    - layers % pp: pp 3 (4 % 3), for tp 1, 2                              2 x 24 = 48
    - gpus not in budget: tp 1 pp 1 dp 1 is 1 GPU < 2                     1 x 12 = 12
      7 (tp, pp, dp) left: (1,1,2) (1,2,1) (1,2,2) (2,1,1) (2,1,2) (2,2,1) (2,2,2), all <= 8 GPUs
    - global_batch % (dp*micro_batch): micro-batch 3                      7 x 4 = 28
      14 left (micro-batch 1 or 4; dp 2 x 4 = 8 divides 8)
    - vp needs pp > 1: vp 2 on the 3 pp-1 prefixes x 2 micro-batches     6 x 2 = 12
    - layers % (pp*vp): 4 % (2*2) = 0                                                  0
    - num_microbatches % pp (interleaved): pp 2, vp 2, m = 8 / (dp*mb) odd only for
      dp 2 micro-batch 4 (m = 1): (1,2,2) and (2,2,2)                     2 x 2 = 4
      20 (..., vp) left: 9 with tp 1 (pp 1: 2; (1,2,1): 4; (1,2,2): 3), 11 with tp 2
    - sp needs tp > 1: the 9 with tp 1                                    9 x 1 = 9
    - seq % tp (sp): 128 % 2 = 0                                                       0
    valid: 9 (tp 1, sp off) + 11 x 2 = 31;  31 + 257 skipped = 288.
    """
    space = SearchSpace(tensor_parallel=(1, 2, 3, 16), pipeline_parallel=(1, 2, 3), data_parallel=(1, 2),
                        micro_batch_size=(1, 3, 4), virtual_pipeline=(1, 2), sequence_parallel=(False, True),
                        recompute=("none",), grad_reduce=("overlap",), distributed_optimizer=(False,), max_tp=8)
    result = plans(space, gpus="2:8", global_batch_size=8)
    assert result.skipped == {
        "tp > max_tp": 72, "heads % tp": 72, "layers % pp": 48, "gpus not in budget": 12,
        "global_batch % (dp*micro_batch)": 28, "vp needs pp > 1": 12, "num_microbatches % pp (interleaved)": 4,
        "sp needs tp > 1": 9}
    assert len(result.candidates) == 31
    assert result.num_skipped + len(result.candidates) == 4 * 3 * 2 * 3 * 2 * 2
    assert list(result.skipped) == [rule for rule in RULES if rule in result.skipped]


def test_default_ranges_on_an_exact_budget():
    """8 GPUs, global batch 16, recompute and gradient reduction pinned to one value each.

    TP: divisors of 8 heads <= 8: 1 2 4 8.  PP: divisors of 4 layers: 1 2 4.  DP = 8 / (tp*pp):
    tp 4 pp 4, tp 8 pp 2 and tp 8 pp 4 need more than 8 GPUs: no DP, 3 x gpus not in budget.
    Micro-batches: divisors of 16 / dp.  VP: 1, and 2 when pp 2 (divisors > 1 of 4 / 2).
    SP: off, and on when tp > 1.  Interleaved (pp 2, vp 2) needs m = 16 / (dp*mb) even.

      tp pp dp  micro-batches   vp 2 fails      plans (x 2 SP when tp > 1)
      1  1  8   1 2                              2
      1  2  4   1 2 4           mb 4 (m 1)       3 + 2 = 5
      1  4  2   1 2 4 8                          4
      2  1  4   1 2 4                            3 x 2 = 6
      2  2  2   1 2 4 8         mb 8 (m 1)       (4 + 3) x 2 = 14
      2  4  1   1 2 4 8 16                       5 x 2 = 10
      4  1  2   1 2 4 8                          4 x 2 = 8
      4  2  1   1 2 4 8 16      mb 16 (m 1)      (5 + 4) x 2 = 18
      8  1  1   1 2 4 8 16                       5 x 2 = 10
                                                 77 plans, 3 interleaved skipped
    """
    pinned = plans(SearchSpace(recompute=("full",), grad_reduce=("after_backward",), distributed_optimizer=(False,)))
    assert len(pinned.candidates) == 77
    assert pinned.skipped == {"gpus not in budget": 3, "num_microbatches % pp (interleaved)": 3}
    # unpinned later axes count once: the same skips, every plan in 3 recompute x 2 reductions, and
    # the 2 + 5 + 4 + 6 + 14 + 8 = 39 plans with dp > 1 with and without the distributed optimizer
    everything = plans(SearchSpace())
    assert len(everything.candidates) == (77 + 39) * 3 * 2
    assert everything.skipped == pinned.skipped


def test_every_plan_is_valid_and_carries_the_training_spec_it_needs():
    training = TrainingSpec(global_batch_size=1, schedule="gpipe", bucket_size_mb=10.0)
    result = plans(SearchSpace(), training=training)
    seen = set()
    for c in result.candidates:
        c.parallel.check_fits(MODEL)
        assert c.num_gpus == 8
        assert c.training.global_batch_size == 16 and c.training.bucket_size_mb == 10.0
        m = c.training.num_microbatches(c.parallel.data_parallel, c.parallel.micro_batch_size)
        if c.parallel.virtual_pipeline > 1:
            assert c.training.schedule is ScheduleKind.INTERLEAVED_1F1B and m % c.parallel.pipeline_parallel == 0
        else:
            assert c.training.schedule is ScheduleKind.GPIPE
        seen.add((c.parallel, c.training.grad_reduce, c.training.distributed_optimizer))
        assert c.training.overlap_param_gather == (c.training.distributed_optimizer
                                                   and c.training.grad_reduce is GradReduce.OVERLAP)
        assert c.parallel.data_parallel > 1 or not c.training.distributed_optimizer
    assert len(seen) == len(result.candidates)
    assert {c.training.grad_reduce for c in result.candidates} == set(GradReduce)
    assert {c.training.distributed_optimizer for c in result.candidates} == {False, True}
    assert {c.parallel.recompute for c in result.candidates} == set(Recompute)


def test_an_interleaved_base_schedule_runs_1f1b_without_a_virtual_pipeline():
    result = plans(SearchSpace(pipeline_parallel=(2,), virtual_pipeline=(1, 2)),
                   training=TrainingSpec(global_batch_size=1, schedule="interleaved_1f1b"))
    assert {(c.parallel.virtual_pipeline, c.training.schedule) for c in result.candidates} == {
        (1, ScheduleKind.ONE_F_ONE_B), (2, ScheduleKind.INTERLEAVED_1F1B)}


def test_a_pinned_tp_above_the_default_limit_is_tried():
    """The default limit is the GPUs per node (8); pinning 16 raises it to 16 instead of skipping
    16 as ``tp > max_tp``, and the unpinned default range stays at 8."""
    wide = ModelSpec(num_layers=4, hidden_size=2048, num_attention_heads=16, seq_length=128, vocab_size=1024)
    pinned = dict(pipeline_parallel=(1,), micro_batch_size=(1,), sequence_parallel=(False,), recompute=("none",),
                  grad_reduce=("overlap",), distributed_optimizer=(False,))
    result = enumerate_plans(wide, SearchSpace(tensor_parallel=(8, 16), **pinned), global_batch_size=16,
                             budget=GpuBudget.parse("16"), training=BASE, gpus_per_node=8)
    assert result.skipped == {}
    assert [(c.parallel.tensor_parallel, c.parallel.data_parallel) for c in result.candidates] == [(8, 2), (16, 1)]
    default = enumerate_plans(wide, SearchSpace(**pinned), global_batch_size=16, budget=GpuBudget.parse("16"),
                              training=BASE, gpus_per_node=8)
    assert max(c.parallel.tensor_parallel for c in default.candidates) == 8
    assert SearchSpace(tensor_parallel=(16,)).tp_limit(8) == 16
    assert SearchSpace(tensor_parallel=(16,), max_tp=4).tp_limit(8) == 4  # a limit given is kept


def test_max_tp_and_sequence_parallel_rules():
    result = plans(SearchSpace(tensor_parallel=(1, 2, 4), max_tp=2, pipeline_parallel=(1,), sequence_parallel=(True,),
                               micro_batch_size=(1,), recompute=("none",), grad_reduce=("overlap",),
                               distributed_optimizer=(False,)))
    assert result.skipped == {"tp > max_tp": 1, "sp needs tp > 1": 1}
    assert [c.parallel for c in result.candidates] == [
        ParallelPlan(tensor_parallel=2, data_parallel=4, sequence_parallel=True)]
    odd_seq = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=100)
    result = enumerate_plans(odd_seq, SearchSpace(tensor_parallel=(8,), pipeline_parallel=(1,), micro_batch_size=(1,),
                                                         sequence_parallel=(True, False)),
                             global_batch_size=16, budget=GpuBudget.parse("8"), training=BASE, gpus_per_node=8)
    assert result.skipped == {"seq % tp (sp)": 1}
    assert {c.parallel.sequence_parallel for c in result.candidates} == {False}


def test_layout_rules_of_the_model_prune_the_default_tensor_parallel_sizes():
    llama = ModelSpec(family="llama", num_layers=2, hidden_size=1024, num_attention_heads=8, num_query_groups=2,
                      seq_length=64)
    result = enumerate_plans(llama, SearchSpace(pipeline_parallel=(1,), micro_batch_size=(1,)),
                             global_batch_size=8, budget=GpuBudget.parse("1:8"), training=BASE, gpus_per_node=8)
    assert {c.parallel.tensor_parallel for c in result.candidates} == {1, 2}
    pinned = enumerate_plans(llama, SearchSpace(tensor_parallel=(2, 4), pipeline_parallel=(1,), data_parallel=(1,)),
                             global_batch_size=8, budget=GpuBudget.parse("1:8"), training=BASE, gpus_per_node=8)
    assert pinned.skipped == {"query groups % tp": 1}
    wide_ffn = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1002, seq_length=64)
    result = enumerate_plans(wide_ffn, SearchSpace(tensor_parallel=(2, 4, 8), pipeline_parallel=(1,), data_parallel=(1,)),
                             global_batch_size=8, budget=GpuBudget.parse("1:8"), training=BASE, gpus_per_node=8)
    assert result.skipped == {"ffn % tp": 2}


@pytest.mark.parametrize("space,gpus,message", [
    (SearchSpace(tensor_parallel=(3, 5)), "8", "no valid plan: 2 skipped (heads % tp: 2)"),
    (SearchSpace(tensor_parallel=(3, 8), pipeline_parallel=(3, 4), recompute=("full", "none")), "8",
     "no valid plan: 8 skipped (heads % tp: 4, layers % pp: 2, gpus not in budget: 2)"),
    (SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2,)), "3",
     "no valid plan: 1 skipped (gpus not in budget: 1)"),
    (SearchSpace(data_parallel=(3,)), "3",  # 4 TP x 3 PP: only tp 1 pp 1 is 3 GPUs
     "no valid plan: 12 skipped (gpus not in budget: 11, global_batch % (dp*micro_batch): 1)"),
])
def test_an_empty_space_names_the_rules_that_emptied_it(space, gpus, message):
    with pytest.raises(ConfigError) as err:
        plans(space, gpus=gpus)
    assert str(err.value) == message


@pytest.mark.parametrize("text,budget,contains", [
    ("3360", GpuBudget(counts=(3360,)), [(3360, True), (3359, False)]),
    ("1024:4096", GpuBudget(low=1024, high=4096), [(1024, True), (4096, True), (4097, False), (1000, False)]),
    ("2240, 2800,3360", GpuBudget(counts=(2240, 2800, 3360)), [(2800, True), (2801, False)]),
])
def test_budget_parsing(text, budget, contains):
    parsed = GpuBudget.parse(text)
    assert parsed == budget and GpuBudget.of(text) == budget
    assert [(n, n in parsed) for n, _ in contains] == contains


def test_budget_data_parallel_sizes():
    assert GpuBudget.parse("2240,2800,3360").data_parallel_sizes(280) == (8, 10, 12)
    assert GpuBudget.parse("2240,2800,3360").data_parallel_sizes(1000) == ()
    assert GpuBudget.parse("10:33").data_parallel_sizes(8) == (2, 3, 4)
    assert GpuBudget.of(8) == GpuBudget.of([8]) == GpuBudget(counts=(8,))
    assert str(GpuBudget.parse("1024:4096")) == "1024:4096" and str(GpuBudget.parse("8,4")) == "4,8"


@pytest.mark.parametrize("text,message", [
    ("0", "--gpus must be positive, got 0"),
    ("4096:1024", "--gpus: the range 4096:1024 is empty (low > high)"),
    ("1024:", "--gpus: '1024:' is not a GPU count (3360), a range LOW:HIGH (1024:4096) or a list (2240,2800,3360)"),
    ("8,x", "--gpus: '8,x' is not a GPU count (3360), a range LOW:HIGH (1024:4096) or a list (2240,2800,3360)"),
    ("1:2:3", "--gpus: '1:2:3' is not a GPU count (3360), a range LOW:HIGH (1024:4096) or a list (2240,2800,3360)"),
])
def test_bad_budgets_are_one_line_errors_naming_the_field(text, message):
    with pytest.raises(ConfigError) as err:
        GpuBudget.parse(text, where="--gpus")
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel=(4, 0)), "search.tensor_parallel: 0 is not a positive integer"),
    (dict(micro_batch_size=(True,)), "search.micro_batch_size: True is not a positive integer"),
    (dict(sequence_parallel=("maybe",)), "search.sequence_parallel: 'maybe' is not on or off"),
    (dict(recompute=("some",)), "search.recompute: 'some' is not one of none, selective, full"),
    (dict(grad_reduce=()), "search.grad_reduce: give at least one value"),
    (dict(max_tp=0), "search.max_tp must be positive, got 0"),
])
def test_bad_axis_values_name_the_field(kwargs, message):
    with pytest.raises(ConfigError) as err:
        SearchSpace(**kwargs)
    assert str(err.value) == message


def test_axis_values_from_text_and_the_axis_table():
    by_flag = {axis.flag: axis for axis in AXES}
    assert by_flag["tp"].values("4, 8,4".split(","), where="--tp") == (4, 8)
    assert by_flag["sp"].values(["on", "OFF"], where="--sp") == (True, False)
    assert by_flag["recompute"].values(["full"], where="--recompute") == (Recompute.FULL,)
    with pytest.raises(ConfigError, match=r"^--pp: 'x' is not a positive integer$"):
        by_flag["pp"].values(["2", "x"], where="--pp")
    assert SearchSpace(tensor_parallel=4, sequence_parallel=True) == SearchSpace(tensor_parallel=(4,),
                                                                                  sequence_parallel=(True,))
    # the axes are the space's fields, in order, and their rules have distinct names
    assert [axis.name for axis in AXES] == [f for f in SearchSpace.__dataclass_fields__ if f != "max_tp"]
    assert len(set(RULES)) == len(RULES)


def test_software_stack_and_fp8_axes_default_to_the_base_training_spec():
    """Unpinned, both axes take the base spec's value: one plan each, as before the axes existed."""
    fixed = dict(tensor_parallel=(2,), pipeline_parallel=(1,), micro_batch_size=(1,), virtual_pipeline=(1,),
                 sequence_parallel=(False,), recompute=("none",), grad_reduce=("overlap",),
                 distributed_optimizer=(False,))
    (plain,) = plans(SearchSpace(**fixed), gpus="8").candidates
    assert (plain.training.software_stack, plain.training.fp8) == (None, None)
    te = TrainingSpec(global_batch_size=1, software_stack="megatron_core_te", fp8="hybrid")
    (fp8,) = plans(SearchSpace(**fixed), gpus="8", training=te).candidates
    assert (fp8.training.software_stack, fp8.training.fp8) == (SoftwareStack.MEGATRON_CORE_TE, Fp8Format.HYBRID)


def test_pinned_fp8_runs_only_with_the_te_stack():
    """4 stacks x (off, hybrid, e4m3): FP8 with any stack but megatron_core_te is skipped (6)."""
    space = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(1,), micro_batch_size=(1,), virtual_pipeline=(1,),
                        sequence_parallel=(False,), recompute=("none",), grad_reduce=("overlap",),
                        distributed_optimizer=(False,), software_stack=tuple(SoftwareStack),
                        fp8=("off", "hybrid", "e4m3"))
    result = plans(space, gpus="8")
    assert result.skipped == {"fp8 needs megatron_core_te": 6}
    assert [(c.training.software_stack.value, c.training.fp8) for c in result.candidates] == [
        ("local_spec", None), ("megatron_deepspeed_2023", None), ("megatron_core_te", None),
        ("megatron_core_te", Fp8Format.HYBRID), ("megatron_core_te", Fp8Format.E4M3), ("megatron_core_local", None)]
    by_flag = {axis.flag: axis for axis in AXES}
    assert by_flag["fp8"].values(["off", "e4m3"], where="--fp8") == (None, Fp8Format.E4M3)
    with pytest.raises(ConfigError, match=r"^--fp8: 'e5m2' is not off or one of hybrid, e4m3$"):
        by_flag["fp8"].values(["e5m2"], where="--fp8")
    with pytest.raises(ConfigError, match=r"^--stack: 'te' is not one of local_spec, megatron_deepspeed_2023, "
                                          r"megatron_core_te, megatron_core_local$"):
        by_flag["stack"].values(["te"], where="--stack")


def test_context_parallel_sizes_are_tried_when_pinned():
    """CP 1 unless pinned. Pinned 1, 2, 3, 8, 128 on a 128-token sequence, 8 GPUs, TP 2, PP 1:
    CP 3 does not divide 128; CP 128 does, but 2 x 128 does not (the load-balanced split);
    TP 2 x CP 8 is 16 GPUs, over the budget; DP = 8 / (TP x CP) is 4 (CP 1) or 2 (CP 2)."""
    assert {c.parallel.context_parallel for c in plans(SearchSpace()).candidates} == {1}
    result = plans(SearchSpace(tensor_parallel=(2,), context_parallel=(1, 2, 3, 8, 128), pipeline_parallel=(1,),
                               micro_batch_size=(1,), sequence_parallel=(True,), recompute=("full",),
                               grad_reduce=("overlap",), distributed_optimizer=(False,)))
    assert result.skipped == {"seq % cp": 1, "seq % (2*cp)": 1, "gpus not in budget": 1}
    assert [(c.parallel.context_parallel, c.parallel.data_parallel, c.num_gpus) for c in result.candidates] == [
        (1, 4, 8), (2, 2, 8)]
    by_flag = {axis.flag: axis for axis in AXES}
    assert by_flag["cp"].values(["2", "4"], where="--cp") == (2, 4)


def test_context_parallelism_runs_only_with_the_te_stack():
    """megatron-core has CP attention only through TransformerEngine: CP 2 with the other stacks is
    skipped (3); CP 1 runs with all four."""
    space = SearchSpace(tensor_parallel=(2,), context_parallel=(1, 2), pipeline_parallel=(1,), micro_batch_size=(1,),
                        virtual_pipeline=(1,), sequence_parallel=(False,), recompute=("none",),
                        grad_reduce=("overlap",), distributed_optimizer=(False,), software_stack=tuple(SoftwareStack))
    result = plans(space, gpus="8")
    assert result.skipped == {"cp needs megatron_core_te": 3}
    assert [(c.parallel.context_parallel, c.training.software_stack.value) for c in result.candidates] == [
        (1, "local_spec"), (1, "megatron_deepspeed_2023"), (1, "megatron_core_te"), (1, "megatron_core_local"),
        (2, "megatron_core_te")]


def test_a_hybrid_space_skips_the_layouts_megatron_cores_mamba_stack_cannot_build():
    """Mamba hybrid "M*-M-M" (16 Mamba heads, 2 groups): TP 4 breaks the groups (2 % 4), CP 2 and VP 3
    (pp 2: 3 layers a rank) are not built; every plan left passes ParallelPlan.check_fits.

    After tp (1, 2, 4) each value counts the pinned later axes, cp 2 x pp 2 x vp 2 = 8: tp 4, 8; cp 2
    for tp 1, 2, 2 x (pp 2 x vp 2) = 8; vp 3 with pp 1 on tp 1, 2 (vp needs pp > 1), 2; vp 3 with
    pp 2 on tp 1, 2 (dp from the budget of 8 GPUs), 2."""
    hybrid = ModelSpec(num_layers=6, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024,
                       hybrid_layer_pattern="M*-M-M", mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=2)
    space = SearchSpace(tensor_parallel=(1, 2, 4), context_parallel=(1, 2), pipeline_parallel=(1, 2),
                        micro_batch_size=(1,), virtual_pipeline=(1, 3), sequence_parallel=(False,),
                        recompute=("none",), grad_reduce=("overlap",), distributed_optimizer=(False,))
    result = enumerate_plans(hybrid, space, global_batch_size=16, budget=GpuBudget.parse("8"), training=BASE,
                             gpus_per_node=8)
    assert result.skipped == {"mamba groups % tp": 8, "hybrid cp": 8, "vp needs pp > 1": 2, "hybrid vp": 2}
    assert [(c.parallel.tensor_parallel, c.parallel.pipeline_parallel, c.parallel.virtual_pipeline)
            for c in result.candidates] == [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1)]
    for candidate in result.candidates:
        candidate.parallel.check_fits(hybrid)
