"""Ranking a search's table: fitting plans first by the objective, the front, the top and train totals."""


import pandas as pd

from vtrain_plugin.planning.search import SearchResult, measures, rank_plans


def table():
    return pd.DataFrame({
        "iteration_time_ms": [300.0, 100.0, 200.0, 50.0, 100.0, 400.0],
        "cost_usd": [1.0, 4.0, 2.0, 0.5, 3.0, 1.0],
        "fits_in_memory": [True, True, True, False, True, True],
        "plan": ["a", "b", "c", "d", "e", "f"],
    })


def test_time_objective_ranks_fitting_plans_first_and_marks_the_front():
    ranked = rank_plans(table(), "time", time_column="iteration_time_ms", cost_column="cost_usd")
    # fitting by time (ties by cost): e(100, 3) b(100, 4) c a f, then the one that does not fit
    assert ranked["plan"].tolist() == ["e", "b", "c", "a", "f", "d"]
    assert ranked["rank"].tolist() == [1, 2, 3, 4, 5, 6]
    # d (50, 0.5) does not fit, so it dominates nothing; f (400, 1) ties a on cost and is slower
    assert ranked.set_index("plan")["pareto"].to_dict() == {
        "e": True, "b": False, "c": True, "a": True, "f": False, "d": False}


def test_cost_objective_and_the_result_views():
    ranked = rank_plans(table(), "cost", time_column="iteration_time_ms", cost_column="cost_usd")
    assert ranked["plan"].tolist() == ["a", "f", "c", "e", "b", "d"]
    result = SearchResult(table=ranked, skipped={}, objective="cost", time_column="iteration_time_ms",
                          cost_column="cost_usd", top_k=2)
    assert result.top()["plan"].tolist() == ["a", "f"] and result.top(3)["plan"].tolist() == ["a", "f", "c"]
    assert result.front["plan"].tolist() == ["e", "c", "a"]
    assert result.num_fitting == 5


def test_measures():
    assert measures(priced=True, tokens=None) == ("iteration_time_ms", "cost_usd")
    assert measures(priced=True, tokens=1e9) == ("train_days", "train_cost_usd")
    assert measures(priced=False, tokens=1e9) == ("train_days", "gpu_hours")
    assert measures(priced=True, tokens=1e9, failures=True) == ("expected_train_days", "expected_train_cost_usd")
    assert measures(priced=False, tokens=1e9, failures=True) == ("expected_train_days", "gpu_hours")
    assert measures(priced=True, tokens=None, failures=True) == ("iteration_time_ms", "cost_usd")
