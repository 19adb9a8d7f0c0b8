"""benchmarks/accuracy/kernel_classes.py's split of a layer into parts (its MoE pieces apart) and its
totals row."""

import pytest

from benchmarks.accuracy.kernel_classes import part_of, part_rows
from vtrain_plugin.core.graph import Phase


@pytest.mark.parametrize("module, phase, part", [
    ("decoder.layers.0.mlp.router", Phase.FORWARD, "moe: router"),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1", Phase.BACKWARD, "moe: experts"),
    ("decoder.layers.0.mlp", Phase.FORWARD, "moe: permutation"),
    ("decoder.layers.0.mlp.token_dispatcher", Phase.FORWARD, "moe: permutation"),
    ("decoder.layers.0.mlp.linear_fc1", Phase.FORWARD, "mlp"),
    ("decoder.layers.0.self_attention.core_attention", Phase.BACKWARD, "attention"),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1", Phase.OPTIMIZER, "optimizer"),
    ("embedding", Phase.FORWARD, "rest"),
])
def test_each_op_falls_in_its_part(module, phase, part):
    assert part_of(module, phase).split(" (")[0] == part


def test_the_last_row_sums_the_parts():
    totals = {"a": [2e6, 4e6, 3, 2, 1e6, 3e6], "b": [1e6, 1e6, 1, 0, 0.0, 0.0]}
    assert part_rows(totals)[-1] == ["all", "4", "3.00", "5.00", "-40", "2", "1.00", "3.00"]
