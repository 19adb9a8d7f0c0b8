"""best_first(): costs plans lowest floor first and stops once the next floor exceeds the top_k-th best
fitting value; a value below its floor makes it cost every plan."""

import numpy as np

from vtrain_plugin.planning import bounded


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
