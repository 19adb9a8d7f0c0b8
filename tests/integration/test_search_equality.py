"""A search row is the one-plan estimate of its plan: sampled rows of dense, MoE, MLA and hybrid
searches, each rebuilt as a plan file and estimated alone, agree in every time, memory and cost
column, exactly (benchmarks/speed/search_equality.py does the same on 240 plans).

Why: the search may cost its plans in arrays and in worker processes; what it ranks must still be
what ``vtrain estimate`` says of each plan.
"""

import pytest

from benchmarks.speed.search_equality import MODELS, compare_kind, mismatch_table
from vtrain_plugin.planning.space import SearchSpace

# TP 2 with SP and PP 2 on 4 or 8 GPUs: one trace shape per kind, a handful of plans (DP, VP, gradient
# reduction, distributed optimizer) sharing it.
SPACE = SearchSpace(tensor_parallel=(2,), pipeline_parallel=(2,), micro_batch_size=(1,), sequence_parallel=(True,),
                    recompute=("none",), software_stack=("megatron_core_te",), fp8=(None,))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_sampled_search_rows_equal_their_one_plan_estimates(kind):
    # the hybrid's search runs in two worker processes: rows from workers are compared too
    searched, compared, mismatches = compare_kind(kind, sample=3, seed=0, space=SPACE, gpus="4,8",
                                                  workers=2 if kind == "hybrid" else 1)
    assert compared == 3 and searched >= 3
    assert not mismatches, "\n" + mismatch_table(mismatches)
