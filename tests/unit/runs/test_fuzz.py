"""Property (issue 10, hostile input): any input file, however mangled, ends in an estimate with
finite numbers or in one ``VTrainError`` with a one-line message — never another exception, a
non-finite number or a hang. 300 examples, derandomized so that CI runs the same ones every time;
``benchmarks/accuracy/fuzz.py`` runs 10,000."""

from hypothesis import HealthCheck, given, settings

from tests.support.fuzzing import CLEAN, Example, examples, outcome


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(example=examples)
def test_any_input_file_estimates_or_fails_with_one_line(example: Example, tmp_path):
    result = outcome(example, tmp_path)
    assert result.kind == CLEAN, f"{example!r}: {result.kind}: {result.detail}"
