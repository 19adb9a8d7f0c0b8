"""Property (issue 10, hostile input): any input file, however mangled, ends in an estimate with
finite numbers or in one ``VTrainError`` with a one-line message — never another exception, a
non-finite number or a hang. 100 drawn examples, derandomized so that CI runs the same ones every
time, and always every pathological document and each kind of damage to each base file (fixed
examples: a draw of 100 does not reach them all). 100 keep the property checked on every run;
``benchmarks/accuracy/fuzz.py`` runs 10,000 to search for new failures."""

from hypothesis import HealthCheck, example, given, settings

from tests.support.fuzzing import CLEAN, DAMAGED, PATHOLOGICAL, Example, examples, outcome


def _with_fixed_examples(test):
    for fixed in (*PATHOLOGICAL, *DAMAGED):
        test = example(example=fixed)(test)
    return test


@settings(max_examples=100, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(example=examples)
@_with_fixed_examples
def test_any_input_file_estimates_or_fails_with_one_line(example: Example, tmp_path):
    result = outcome(example, tmp_path)
    assert result.kind == CLEAN, f"{example!r}: {result.kind}: {result.detail}"
