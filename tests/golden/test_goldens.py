"""Golden numbers: the headline estimates must not move unless a commit says why (see cases.py)."""

import json
import math

import pytest

from tests.golden.cases import VALUES, cases, observe

GOLDEN = json.loads(VALUES.read_text())
REL = 1e-6


def _compare(observed, expected, where: str) -> list[str]:
    if isinstance(expected, dict):
        problems = [] if observed.keys() == expected.keys() else [f"{where}: keys {sorted(observed)}"]
        return problems + [p for k in expected.keys() & observed.keys()
                           for p in _compare(observed[k], expected[k], f"{where}.{k}")]
    if isinstance(expected, list):
        if len(observed) != len(expected):
            return [f"{where}: {len(observed)} entries, golden {len(expected)}"]
        return [p for i, (o, e) in enumerate(zip(observed, expected)) for p in _compare(o, e, f"{where}[{i}]")]
    if isinstance(expected, float) or isinstance(observed, float):
        if not math.isclose(observed, expected, rel_tol=REL, abs_tol=1e-9):
            return [f"{where}: {observed!r}, golden {expected!r}"]
        return []
    return [] if observed == expected else [f"{where}: {observed!r}, golden {expected!r}"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cases(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_estimate_matches_its_golden(files, name):
    problems = _compare(observe(files[name]), GOLDEN[name], name)
    assert not problems, "\n".join(problems[:20])


def test_every_case_has_a_golden(files):
    assert sorted(files) == sorted(GOLDEN)
