"""Build a megatron-core module on the fake process group and record one forward and backward of it
with vtrain's recorder: the harness of the stand-in tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_adapters.cpu_patches import cpu_tracing_patches
from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
from vtrain_plugin.capture.recorder import OpRecorder
from vtrain_plugin.capture.records import CollectiveRecord, OpRecord
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.specs.parallel import ParallelPlan

BF16 = torch.bfloat16
# The TransformerConfig fields every traced model needs on a CPU (DESIGN.md, "Known facts").
CPU_FIELDS = dict(use_cpu_initialization=True, perform_initialization=False, params_dtype=BF16, pipeline_dtype=BF16,
                  bf16=True, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                  bias_dropout_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
                  persist_layer_norm=False)


@dataclass
class Recorded:
    records: list
    parameters: dict[str, tuple[int, ...]]  # name -> shape
    group_names: dict

    def ops(self, phase: Phase, module: str = "", *, kernels_only: bool = True) -> list[OpRecord]:
        return [r for r in self.records if isinstance(r, OpRecord) and r.phase is phase and module in r.module
                and (r.launches_kernel or not kernels_only)]

    def count(self, phase: Phase, op: str, module: str = "") -> Counter:
        """Input shapes of each ``op`` call of ``phase`` in modules whose name contains ``module``."""
        return Counter(r.key.input_shapes for r in self.ops(phase, module) if r.key.op == op)

    def collectives(self) -> list[CollectiveRecord]:
        return [r for r in self.records if isinstance(r, CollectiveRecord)]

    def numel(self, prefix: str = "") -> int:
        return sum(_prod(s) for name, s in self.parameters.items() if name.startswith(prefix))


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def record(build: Callable[[], torch.nn.Module], inputs: Callable[[], tuple], *,
           plan: ParallelPlan = ParallelPlan(), call: Callable = lambda module, args: module(*args),
           output: Callable = lambda out: out) -> Recorded:
    """``build()`` the module and ``inputs()`` its arguments inside the fake world and FakeTensorMode,
    then record ``call(module, inputs)`` (forward; by default ``module(*inputs)``), a sum of
    ``output(result)`` (module ``loss``) and its backward."""
    with quiet_megatron(), cpu_tracing_patches(), fake_world(plan) as group_names:
        reset_global_memory_buffer()
        with FakeTensorMode(allow_non_fake_inputs=True):
            module = build()
            recorder = OpRecorder(module)
            with recorder.recording():
                with recorder.paused():
                    args = inputs()
                with recorder.phase(Phase.FORWARD):
                    out = call(module, args)
                    with recorder.module("loss"):
                        loss = output(out).float().sum()
                with recorder.phase(Phase.BACKWARD):
                    loss.backward()
            parameters = {name: tuple(p.shape) for name, p in module.named_parameters()}
        reset_global_memory_buffer()
    return Recorded(records=recorder.records, parameters=parameters, group_names=group_names)
