"""Checkpoint bytes equal those of megatron-core's own sharded state dict: every pipeline stage's
chunks built on a fake process group, their ShardedTensors summed once per key at their global
shapes (replicas, the tied output layer and the TP shards counted once), plus the optimizer's
model-space state (fp32 main weight and two Adam moments per parameter)."""

import math

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.cost.checkpoint import checkpoint_size
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

GPT = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)
LLAMA = ModelSpec(family="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  seq_length=32, vocab_size=1000)


def megatron_checkpoint_elements(model: ModelSpec, plan: ParallelPlan) -> dict[str, tuple[int, ...]]:
    """Global shape of every sharded tensor of the model's checkpoint, by key, over all stages."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_adapters.conventions import chunk_role
    from megatron_adapters.cpu_patches import cpu_tracing_patches
    from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
    from megatron_adapters.gpt import build_chunk

    shapes: dict[str, tuple[int, ...]] = {}
    for rank in range(plan.pipeline_parallel):
        for chunk in range(plan.virtual_pipeline):
            layers = plan.chunk_layers(model)[rank][chunk]
            with quiet_megatron(), cpu_tracing_patches(), fake_world(plan, pipeline_rank=rank):
                reset_global_memory_buffer()
                with FakeTensorMode(allow_non_fake_inputs=True):
                    gpt = build_chunk(model, plan, chunk_role(plan, rank, chunk), layers_per_chunk=layers)
                    state = gpt.sharded_state_dict()
                reset_global_memory_buffer()
            for value in state.values():
                # a factory (SwiGLU's fc1: the gate and up halves) builds its ShardedTensors on save
                for tensor in value.build() if isinstance(value, ShardedTensorFactory) else [value]:
                    if isinstance(tensor, ShardedTensor):
                        assert shapes.setdefault(tensor.key, tuple(tensor.global_shape)) == tuple(tensor.global_shape)
    return shapes


@pytest.mark.parametrize("model,plan", [
    (GPT, ParallelPlan(tensor_parallel=1, pipeline_parallel=1, micro_batch_size=1)),
    (GPT, ParallelPlan(tensor_parallel=2, pipeline_parallel=2, micro_batch_size=1)),
    (LLAMA, ParallelPlan(tensor_parallel=2, pipeline_parallel=2, micro_batch_size=1)),
])
def test_checkpoint_bytes_equal_megatron_core_sharded_state(model, plan):
    elements = sum(math.prod(shape) for shape in megatron_checkpoint_elements(model, plan).values())
    size = checkpoint_size(trace(model, plan))
    assert size.parameters == elements
    assert size.model_nbytes == 2 * elements  # bf16 weights
    assert size.optimizer_nbytes == 12 * elements  # fp32 main weight, exp_avg, exp_avg_sq


def test_fp32_models_save_no_separate_main_weights():
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
                      dtype=Dtype.FP32)
    size = checkpoint_size(trace(model, ParallelPlan(micro_batch_size=1)))
    assert (size.model_nbytes, size.optimizer_nbytes) == (4 * size.parameters, 8 * size.parameters)
