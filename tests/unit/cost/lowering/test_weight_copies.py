"""The main weights copied into the model's one parameter at a time where megatron-core loops (bf16,
or the distributed optimizer): one copy per parameter in place of the multi-tensor pass, ceil(P / S)
of them on S shards (experts over their own shards), exact on a hand-built block and on a traced GPT
layer's twelve parameters; fp16 without the distributed optimizer keeps the pass."""

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import Block, BlockKind, KernelKey, OpNode, Phase
from vtrain_plugin.cost.lowering.weight_copies import COPY_OP, looped, weight_copies
from vtrain_plugin.cost.prepare import prepare_run
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

LAYER = "decoder.layers.0"


def _pass(op: str, numel: int) -> OpNode:
    return OpNode(key=KernelKey(op=f"te.{op}.default", input_shapes=((numel,),), dtypes=("float32",)),
                  phase=Phase.OPTIMIZER, module=f"{LAYER}.norm", output_shapes=((numel,),), nbytes=6 * numel)


def _block() -> Block:
    dense, experts = (1000, 10, 30), (500, 500)
    return Block(kind=BlockKind.LAYER, name=LAYER, num_parameters=sum(dense) + sum(experts),
                 parameter_numels=dense, expert_parameter_numels=experts)


def test_megatron_core_loops_for_bf16_and_under_the_distributed_optimizer():
    assert looped(Dtype.BF16, distributed_optimizer=False, precision_aware=False, torch_fsdp=False)
    assert looped(Dtype.FP16, distributed_optimizer=True, precision_aware=False, torch_fsdp=False)
    assert not looped(Dtype.FP16, distributed_optimizer=False, precision_aware=False, torch_fsdp=False)
    assert not looped(Dtype.FP32, distributed_optimizer=True, precision_aware=False, torch_fsdp=False)
    assert not looped(Dtype.BF16, distributed_optimizer=True, precision_aware=True, torch_fsdp=False)
    assert not looped(Dtype.BF16, distributed_optimizer=True, precision_aware=False, torch_fsdp=True)


def test_the_pass_becomes_one_copy_per_parameter():
    adam, copy = _pass("multi_tensor_adam", 2040), _pass("multi_tensor_copy", 2040)
    out = weight_copies((adam, copy), _block(), Dtype.BF16)
    assert out[0] is adam
    copies = out[1:]
    assert [n.op for n in copies] == [COPY_OP] * 5
    assert [n.key.input_shapes[0] for n in copies] == [(1000,), (10,), (30,), (500,), (500,)]
    assert [n.key.dtypes for n in copies] == [("bfloat16", "float32")] * 5
    assert sum(n.nbytes for n in copies) == 6 * 2040  # bf16 written, fp32 read: the pass's bytes
    assert all(n.phase is Phase.OPTIMIZER and n.module == copy.module for n in copies)


def test_a_shard_copies_its_share_of_the_parameters():
    copy = _pass("multi_tensor_copy", 1020)
    copies = weight_copies((copy,), _block(), Dtype.BF16, shards=2, expert_shards=4)
    # dense: ceil(3 / 2) = 2 copies of ceil(1040 / 4) = 260; experts: ceil(2 / 4) = 1 copy of 250
    assert [n.key.input_shapes[0] for n in copies] == [(260,), (260,), (250,)]


MODEL = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, dtype="bf16")


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, ParallelPlan(data_parallel=2))


def _layer_step(graph, training: TrainingSpec) -> list[str]:
    role = prepare_run(graph, "megatron_core_te", training).stages[0].role
    (segment,) = [s for s in role.segments if s.phase is Phase.OPTIMIZER and role.blocks[s.block].kind is BlockKind.LAYER]
    return [n.op for n in role.nodes[segment.start:segment.stop] if n is not None]


def test_a_traced_gpt_layer_copies_its_twelve_parameters_or_its_shards_six(graph):
    # GPT layer: QKV, projection, FC1, FC2 weights and biases, two norms' weight and bias: 12
    assert _layer_step(graph, TrainingSpec(global_batch_size=4)).count(COPY_OP) == 12
    step = _layer_step(graph, TrainingSpec(global_batch_size=4, distributed_optimizer=True))
    assert step.count(COPY_OP) == 6
    assert not any("multi_tensor_copy" in op for op in step)


def test_fp16_without_the_distributed_optimizer_keeps_the_pass():
    fp16 = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512,
                     dtype="fp16")
    step = _layer_step(trace(fp16, ParallelPlan(data_parallel=2)), TrainingSpec(global_batch_size=4))
    assert COPY_OP not in step
    assert step.count("te.multi_tensor_copy.default") == 1
