"""The comparisons say which they are: compare_iterations (timed iterations) and compare_run (logs);
the old names still import, with a DeprecationWarning that names the new one."""

import pytest

import vtrain_plugin as vtrain
from vtrain_plugin import measured


def test_new_names_are_the_measured_packages_own():
    assert vtrain.compare_iterations is measured.compare_iterations
    assert vtrain.IterationComparison is measured.IterationComparison
    assert vtrain.compare_run is measured.compare_run and vtrain.validate is measured.validate
    assert vtrain.compare_iterations(110.0, [90.0, 100.0, 130.0]).error_pct == pytest.approx(10.0)


@pytest.mark.parametrize("old, new", [("compare", "compare_iterations"), ("Comparison", "IterationComparison")])
def test_old_names_warn_and_give_the_new_ones(old, new):
    with pytest.warns(DeprecationWarning, match=f"vtrain_plugin.{old} is deprecated; use vtrain_plugin.{new}"):
        value = getattr(vtrain, old)
    assert value is getattr(vtrain, new)
    with pytest.warns(DeprecationWarning):
        exec(f"from vtrain_plugin import {old}", {})


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'compare_runs'"):
        vtrain.compare_runs  # noqa: B018
