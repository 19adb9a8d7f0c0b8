"""The optimizer step as a moment of its own (vtrain_plugin.cost.memory): with a bf16 model's
gradients in bf16 (``grad_reduce_in_bf16``), Megatron's optimizer copies the rank's gradient shard
into fp32 main gradients, all live until the step ends; where they are more than the activations at
the backward's peak they are the activations counted."""

from __future__ import annotations

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.memory import rank_memory
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan


def _graph(dtype: str = "bf16", dp: int = 1):
    model = ModelSpec(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=256, dtype=dtype)
    return trace(model, ParallelPlan(data_parallel=dp, micro_batch_size=1))


def _no_activations(rank, chunk_nbytes, rise_nbytes):  # a schedule that holds no stash at its peak
    return 0, 1


@pytest.mark.parametrize("distributed, dp", [(False, 1), (True, 4)])
def test_bf16_gradients_make_fp32_copies_of_the_ranks_shard(distributed, dp):
    graph = _graph(dp=dp)
    params = graph.stages[0].num_parameters
    memory = rank_memory(graph, _no_activations, gradients=Dtype.BF16, distributed_optimizer=distributed)[0]
    assert memory.activations_gib * GIB == pytest.approx(4 * params / dp)
    assert memory.gradients_gib * GIB == 2 * params


def test_fp32_gradients_are_the_main_gradients_themselves():
    graph = _graph()
    assert rank_memory(graph, _no_activations)[0].activations_gib == 0


def test_the_copies_count_only_where_they_are_more_than_the_backwards_activations():
    graph = _graph()
    params = graph.stages[0].num_parameters
    more = 8 * params
    memory = rank_memory(graph, lambda rank, chunks, rises: (more, 1), gradients=Dtype.BF16)[0]
    assert memory.activations_gib * GIB == more
