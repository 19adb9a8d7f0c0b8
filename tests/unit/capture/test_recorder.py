"""The recorder's per-op facts: autograd's next sequence number read without taking one, and what
opinfo keeps per op overload standing for every call of it (the arguments still read per call)."""

import torch

from vtrain_plugin.capture import opinfo
from vtrain_plugin.capture.recorder import OpRecorder


def test_the_next_sequence_number_is_the_next_nodes_and_reading_it_takes_none():
    recorder = OpRecorder(torch.nn.Linear(2, 2))
    with torch.enable_grad():
        first = recorder._next_sequence_nr()
        assert recorder._next_sequence_nr() == first
        y = torch.ones(2, requires_grad=True) * 2
        z = y + 1
    assert y.grad_fn._sequence_nr() == first
    assert z.grad_fn._sequence_nr() == first + 1
    assert recorder._next_sequence_nr() == first + 2


def test_what_is_kept_per_op_overload_leaves_each_calls_arguments_their_own():
    add = torch.ops.aten.add.Tensor
    a, b = torch.ones(2, 3), torch.ones(3, dtype=torch.float16)
    assert opinfo.op_info(add) is opinfo.op_info(add)
    two = opinfo.kernel_key(add, (a, b), {"alpha": 2})
    true = opinfo.kernel_key(add, (a, a), {"alpha": True})
    assert two.op == true.op == "aten.add.Tensor"
    assert (two.input_shapes, two.dtypes, two.args) == (((2, 3), (3,)), ("float32", "float16"), (("alpha", 2),))
    assert (true.input_shapes, true.dtypes) == (((2, 3), (2, 3)), ("float32", "float32"))
    assert true.args == (("alpha", True),) and type(true.args[0][1]) is bool
    assert opinfo.launches_kernel(add, (a, b), {}, a + b)
    assert not opinfo.launches_kernel(torch.ops.aten.view.default, (a, [6]), {}, a.view(6))
    assert opinfo.flops(torch.ops.aten.mm.default, (a, torch.ones(3, 4)), {}, torch.ones(2, 4)) == 2 * 2 * 3 * 4
    assert opinfo.flops(add, (a, b), {}, a + b) == 0
