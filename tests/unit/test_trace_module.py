"""Tracing a plain torch.nn.Module on the meta device."""

import torch

from vtrain_plugin.core.graph import Phase
from vtrain_plugin.capture.tracer import trace


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_plain_module_is_traced_with_modules_and_phases():
    graph = trace(TwoLayer(), sample_input=torch.randn(8, 32))
    (stage,) = graph.stages
    ops = list(stage.blocks[0].ops())
    forward = [(op.op, op.module) for op in ops if op.phase is Phase.FORWARD]
    assert ("aten.addmm.default", "fc1") in forward and ("aten.addmm.default", "fc2") in forward
    backward_mm = [op for op in ops if op.phase is Phase.BACKWARD and op.op == "aten.mm.default"]
    assert {op.module for op in backward_mm} == {"fc1", "fc2"}
    assert any(op.phase is Phase.OPTIMIZER for op in ops)
    assert stage.num_parameters == 32 * 64 + 64 + 64 * 16 + 16
    # 2*M*N*K per GEMM; forward + two backward GEMMs for fc2, forward + weight-grad for fc1
    assert graph.flops(Phase.FORWARD) == 2 * 8 * (32 * 64 + 64 * 16)
    assert graph.micro_batch_size == 8
