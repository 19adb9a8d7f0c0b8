"""Megatron-Core DDP's forward pre-hooks under overlap_param_gather: one hook call per module called in
a forward or recompute segment (its first kernel's row; the modules above it inside the block once),
none in the backward, none for the loss; charged only with the distributed optimizer and
overlap_param_gather without FSDP, at PRE_HOOK_NS times the host factor each (exact on a traced GPT)."""

import numpy as np
import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import Block, BlockKind, Phase
from vtrain_plugin.cost.comm.collectives import CommModel
from vtrain_plugin.cost.costing import _row_modules, role_times
from vtrain_plugin.cost.ddp_hooks import PRE_HOOK_NS, forward_pre_hooks, hook_calls
from vtrain_plugin.cost.kernels.host_device import Segment
from vtrain_plugin.cost.kernels.timer import KernelTimer
from vtrain_plugin.cost.prepare import prepare_run
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.specs.fsdp import FsdpSettings
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

LAYER = "decoder.layers.0"
ROWS = [f"{LAYER}.self_attention.linear_qkv", f"{LAYER}.self_attention.linear_qkv",
        f"{LAYER}.self_attention.core_attention", "", f"{LAYER}.mlp.linear_fc1", "loss"]


def _segments(phase: Phase, block: int = 0) -> list[Segment]:
    return [Segment(block=block, phase=phase, start=0, stop=len(ROWS), count=1)]


def test_each_module_and_those_above_it_in_the_block_are_called_once_per_segment():
    layer = Block(kind=BlockKind.LAYER, name=LAYER)
    # qkv, its attention and the layer; core attention; nothing; fc1 and its MLP; the loss is no module
    expected = [3, 0, 1, 0, 2, 0]
    assert hook_calls(ROWS, _segments(Phase.FORWARD), [layer]).tolist() == expected
    assert hook_calls(ROWS, _segments(Phase.RECOMPUTE), [layer]).tolist() == expected
    assert not hook_calls(ROWS, _segments(Phase.BACKWARD), [layer]).any()
    assert not hook_calls(ROWS, _segments(Phase.OPTIMIZER), [layer]).any()


def test_modules_outside_the_block_name_count_alone():
    head = Block(kind=BlockKind.HEAD, name="head")
    rows = ["decoder.final_layernorm", "output_layer", "output_layer", "loss"]
    segments = [Segment(block=0, phase=Phase.FORWARD, start=0, stop=4, count=1)]
    assert hook_calls(rows, segments, [head]).tolist() == [1, 1, 0, 0]


def test_the_hooks_need_the_distributed_optimizer_and_overlapped_gathers_without_fsdp():
    assert forward_pre_hooks(TrainingSpec(global_batch_size=4, distributed_optimizer=True, overlap_param_gather=True))
    assert not forward_pre_hooks(TrainingSpec(global_batch_size=4, distributed_optimizer=True))
    assert not forward_pre_hooks(TrainingSpec(global_batch_size=4))
    fsdp = TrainingSpec(global_batch_size=4, distributed_optimizer=True, overlap_param_gather=True,
                        fsdp=FsdpSettings(implementation="megatron"))
    assert not forward_pre_hooks(fsdp)


MODEL = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, dtype="bf16")
PLAN = ParallelPlan(data_parallel=2)


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, PLAN)


def test_a_traced_gpt_pays_each_hook_call_at_the_measured_cost(graph):
    plain = TrainingSpec(global_batch_size=4, distributed_optimizer=True)
    hooked = TrainingSpec(global_batch_size=4, distributed_optimizer=True, overlap_param_gather=True)
    timer = KernelTimer(get_device("h100-sxm"), calibration_for("h100-sxm", "megatron_core_te").constants)
    comm = CommModel.for_plan(get_cluster_preset("dgx-h100"), PLAN)
    stage = prepare_run(graph, "megatron_core_te", plain).stages[0]
    calls = hook_calls(_row_modules(stage.role), stage.role.segments, stage.stage.blocks)
    layer = next(s for s in stage.role.segments
                 if s.phase is Phase.FORWARD and stage.stage.blocks[s.block].kind is BlockKind.LAYER)
    # a traced layer's forward: norms, QKV, attention, core attention, projection, the layer, MLP, FC1, FC2
    assert calls[layer.start:layer.stop].sum() >= 9
    extra = (role_times(stage, timer, comm, hooked, MODEL, PLAN).host
             - role_times(stage, timer, comm, plain, MODEL, PLAN).host)
    np.testing.assert_allclose(extra, timer.constants.host_time_factor * PRE_HOOK_NS * calls)
