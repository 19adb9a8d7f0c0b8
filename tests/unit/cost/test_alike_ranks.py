"""Memory worked out once per kind of pipeline rank, on a small real megatron-core Llama traced on the
fake process group (PP 4: the first rank, two middle ranks alike, the last): the kinds found, and every
rank's memory exactly what it is when no two ranks are taken as alike, for the options whose
per-stage work the stack adjusts (offloading, CUDA graphs captured apart, FP8 weights, FSDP)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vtrain_plugin.cost.memory import alike_ranks, rank_memory
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.sim.schedules import build_schedule
from vtrain_plugin.specs.activation_offload import ActivationOffload
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.fsdp import FsdpSettings
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import CudaGraphImpl, SoftwareStack, TrainingSpec

MODEL = ModelSpec(family="llama", num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                  vocab_size=256, dtype="bf16")
PLAN = ParallelPlan(pipeline_parallel=4, data_parallel=2, micro_batch_size=2)


@pytest.fixture(scope="module")
def graph():
    from vtrain_plugin.capture.tracer import trace

    return trace(MODEL, PLAN)


def _apart(graph):
    """``graph`` with every stage's blocks a tuple of its own: no two ranks alike."""
    return replace(graph, stages=tuple(replace(s, blocks=tuple(list(s.blocks))) for s in graph.stages))


def test_the_middle_ranks_are_one_kind(graph):
    compact, ranks = alike_ranks(graph)
    assert ranks == (0, 1, 1, 3)
    assert [s.pipeline_rank for s in compact.stages] == [0, 1, 3]
    assert alike_ranks(_apart(graph))[1] == (0, 1, 2, 3)


@pytest.mark.parametrize("options", [
    {},
    {"distributed_optimizer": True},
    {"activation_offload": ActivationOffload(modules=("qkv_linear", "core_attn"), min_tensor_elements=1)},
    {"cuda_graph_impl": CudaGraphImpl.TRANSFORMER_ENGINE, "cuda_graph_warmup_steps": 0},
    {"fp8": "hybrid", "fp8_param_gather": True, "distributed_optimizer": True},
    {"fsdp": FsdpSettings()},
], ids=["plain", "distributed-optimizer", "offload", "cuda-graphs", "fp8-weights", "fsdp"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_rank_as_if_worked_out_alone(graph, options, schedule):
    training = TrainingSpec(global_batch_size=16, schedule=schedule, **options)
    walk = build_schedule(schedule, 4, 1, training.num_microbatches(2, 2)).peak_live
    args = (SoftwareStack.MEGATRON_CORE_TE, training, GpuArchitecture.HOPPER)
    shared = stack_rank_memory(graph, walk, *args)
    assert shared == stack_rank_memory(_apart(graph), walk, *args)
    # the middle ranks hold as many micro-batches under GPipe: one result for both
    assert (shared[1] is shared[2]) == (schedule == "gpipe")
    assert rank_memory(graph, walk) == rank_memory(_apart(graph), walk)
