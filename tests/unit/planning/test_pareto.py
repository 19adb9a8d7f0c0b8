"""The Pareto front of (time, cost) among fitting plans, against the definition by brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain_plugin.planning.pareto import pareto_front


def dominates(a, b):
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


# small integers make ties in time, in cost and in both common
values = st.integers(min_value=0, max_value=6).map(float)
plans = st.lists(st.tuples(values, values, st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(plans)
def test_front_is_exactly_the_undominated_fitting_plans(points):
    time = [p[0] for p in points]
    cost = [p[1] for p in points]
    fits = [p[2] for p in points]
    front = pareto_front(time, cost, fits)
    fitting = [(p[0], p[1]) for p in points if p[2]]
    for (t, c, fit), on_front in zip(points, front):
        if not fit:
            assert not on_front  # never on the front
        elif on_front:
            assert not any(dominates(other, (t, c)) for other in fitting)  # no front plan is dominated
        else:
            assert any(dominates(other, (t, c)) for other in fitting)  # every fitting plan off it is
    assert front.any() == bool(fitting)


def test_a_small_front_by_hand():
    time = [1.0, 2.0, 2.0, 3.0, 0.5, 4.0, 3.0]
    cost = [5.0, 3.0, 4.0, 3.0, 1.0, 1.0, 2.0]
    fits = [True, True, True, True, False, True, True]
    # (0.5, 1) does not fit; (2, 4) loses to (2, 3), (3, 3) to (2, 3), (3, 2) and (4, 1) stay
    assert pareto_front(time, cost, fits).tolist() == [True, True, False, False, False, True, True]


def test_identical_plans_are_on_the_front_together_and_shapes_must_agree():
    assert pareto_front([1.0, 1.0], [2.0, 2.0], [True, True]).tolist() == [True, True]
    assert pareto_front([], [], []).tolist() == []
    with pytest.raises(ValueError, match="one length"):
        pareto_front([1.0], [1.0, 2.0], [True])
    assert pareto_front(np.array([1.0]), np.array([1.0]), np.array([False])).tolist() == [False]
