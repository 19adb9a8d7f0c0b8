"""``vtrain size``'s table: a shape judged over budget by its floors alone shows the floor, not a plan."""

from vtrain_plugin.cli.render import sizing_table
from vtrain_plugin.planning.model_family import family_shape, naive_size
from vtrain_plugin.planning.sizing import ShapeOutcome, SizingResult

SMALL, LARGE = family_shape("gpt", 3072), family_shape("gpt", 15360)
PLAN = {"tensor_parallel": 2, "pipeline_parallel": 4, "data_parallel": 64, "micro_batch_size": 1,
        "recompute": "none", "num_gpus": 512, "mfu": 0.5, "expected_train_days": 0.17,
        "expected_train_cost_usd": 1000.0, "goodput": 0.99, "train_days": 0.16}


def test_a_row_over_budget_by_its_floors_gives_the_floor_and_no_plan():
    answer = ShapeOutcome(model=SMALL, tokens=20.0 * SMALL.num_parameters, plan=PLAN, within_budget=True, reason="")
    floored = ShapeOutcome(model=LARGE, tokens=20.0 * LARGE.num_parameters, within_budget=False, floor_days=217.4,
                           reason="needs more than 217 days > 30 (every plan's floor; none costed)")
    naive = naive_size("gpt", peak_tflop_per_s=312, gpus=3360, days=30)
    result = SizingResult(answer=answer, evaluated=(answer, floored), naive=naive, naive_outcome=floored, days=30,
                          budget_usd=None, naive_mfu=0.5)
    lines = sizing_table(result).splitlines()
    row = next(line for line in lines if line.startswith(LARGE.name))
    assert "none costed: every floor over budget" in row and "> 217.4" in row and row.rstrip().endswith("no")
    assert lines[-1].endswith("(vtrain: more than 217.4 days, over budget)")
    assert floored.to_dict()["floor_days"] == 217.4 and answer.to_dict()["floor_days"] is None
