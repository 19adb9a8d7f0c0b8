"""size_model()'s bisection (planning/sizing.py _bisect): on a ladder whose verdicts are monotone it
finds the largest shape within budget, as the bisection that first checks the smallest shape does,
with the same searches but that one: the smallest shape is searched only when no larger one is
within budget."""

from dataclasses import dataclass

from vtrain_plugin.planning.sizing import _bisect

LADDER = 25  # as many shapes as `vtrain size`'s default gpt ladder (1e9 to 2e12 parameters)


@dataclass(frozen=True)
class Shape:
    num_parameters: int


@dataclass(frozen=True)
class Verdict:
    within_budget: bool


def _judge(largest_within: int, judged: list[int]):
    """Shapes up to ``largest_within`` (-1: none) are within budget; each search recorded once."""
    def judge(shape: Shape) -> Verdict:
        if shape.num_parameters not in judged:
            judged.append(shape.num_parameters)
        return Verdict(shape.num_parameters <= largest_within)
    return judge


def _plain_bisection(shapes, judge) -> int | None:
    """The smallest shape first, then the bisection, then the naive answer (searched for the report)."""
    if not judge(shapes[0]).within_budget:
        return None
    low, high = 0, len(shapes) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if judge(shapes[middle]).within_budget:
            low = middle
        else:
            high = middle - 1
    return low


def test_the_answer_is_the_plain_bisections_without_searching_the_smallest_shape():
    shapes = [Shape(i) for i in range(LADDER)]
    for largest_within in range(-1, LADDER):
        judged: list[int] = []
        answer = _bisect(shapes, _judge(largest_within, judged))
        plain: list[int] = []
        assert answer == _plain_bisection(shapes, _judge(largest_within, plain))
        assert answer == (None if largest_within < 0 else largest_within)
        if largest_within > 0:
            assert judged == plain[1:] and plain[0] == 0
        else:  # the smallest shape decides, searched last (a budget too small: after the bisection's)
            assert judged[-1] == 0 and set(plain) <= set(judged)
