"""Megatron-Core DDP's per-parameter gradient hook: one main_grad add per parameter and micro-batch,
none for linear weights under gradient-accumulation fusion (exact on a hand-built block and on a
traced megatron-core GPT), only on the Megatron-Core stacks, and read from Megatron-LM's flag."""

from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import Block, BlockKind, KernelKey, OpNode, Phase
from vtrain_plugin.cost.lowering.grad_hooks import ADD_OP, COPY_OP, GradHooks, grad_hook_adds, hooked_numels
from vtrain_plugin.cost.prepare import prepare_run
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.runs import run_config_from_megatron_args
from vtrain_plugin.specs.fsdp import FsdpSettings
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

LAYER = "decoder.layers.0"
BF16_INTO_FP32 = GradHooks(fused_weights=True, grad=Dtype.BF16, main_grad=Dtype.FP32)


def _op(op: str, phase: Phase, module: str, *shapes: tuple[int, ...], out: tuple[int, ...] = ()) -> OpNode:
    return OpNode(key=KernelKey(op=op, input_shapes=shapes, dtypes=("bfloat16",) * len(shapes)), phase=phase,
                  module=module, output_shapes=(out,) if out else ())


def _block() -> Block:
    """A layer with a 1536 x 512 weight (its gradient a backward mm), its bias, a norm's 512 and one
    expert parameter of 1000 elements."""
    nodes = (_op("aten.mm.default", Phase.FORWARD, f"{LAYER}.linear", (8, 512), (512, 1536), out=(8, 1536)),
             _op("aten.mm.default", Phase.BACKWARD, f"{LAYER}.linear", (1536, 8), (8, 512), out=(1536, 512)),
             _op("aten.mm.default", Phase.BACKWARD, f"{LAYER}.linear", (8, 1536), (1536, 512), out=(8, 512)),
             _op("aten.sum.dim_IntList", Phase.BACKWARD, f"{LAYER}.norm", (8, 512), out=(512,)))
    return Block(kind=BlockKind.LAYER, name=LAYER, nodes=nodes, num_parameters=1536 * 512 + 1536 + 512 + 1000,
                 parameter_numels=(1536 * 512, 1536, 512), expert_parameter_numels=(1000,))


def test_fusion_leaves_out_the_weights_whose_gradient_a_gemm_computes():
    block = _block()
    assert hooked_numels(block, BF16_INTO_FP32) == (1536, 512, 1000)
    unfused = GradHooks(fused_weights=False, grad=Dtype.BF16, main_grad=Dtype.FP32)
    assert hooked_numels(block, unfused) == (1536 * 512, 1536, 512, 1000)


def test_each_hooked_parameter_adds_one_kernel_after_the_backward():
    block = _block()
    out = grad_hook_adds(block.nodes, block, BF16_INTO_FP32)
    adds = out[len(block.nodes):]
    assert out[:len(block.nodes)] == block.nodes
    assert [n.op for n in adds] == [ADD_OP] * 3
    assert all(n.phase is Phase.BACKWARD and n.module == f"{LAYER}.norm" for n in adds)
    # read the bf16 gradient (2 bytes), read and write the fp32 main_grad (4 + 4)
    assert [n.nbytes for n in adds] == [10 * 1536, 10 * 512, 10 * 1000]
    assert grad_hook_adds(block.nodes, block, None) == block.nodes


MODEL = ModelSpec(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, dtype="bf16")


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, ParallelPlan(data_parallel=2))


def _adds_per_layer(graph, stack: str, training: TrainingSpec, op: str = ADD_OP) -> list[int]:
    role = prepare_run(graph, stack, training).stages[0].role
    return [sum(n is not None and n.op == op and n.nbytes > 0 and n.key.dtypes == ("float32", "bfloat16")
                for n in role.nodes[s.start:s.stop])
            for s in role.segments if s.phase is Phase.BACKWARD and role.blocks[s.block].kind is BlockKind.LAYER]


def test_a_traced_gpt_layer_hooks_its_twelve_parameters_or_the_eight_not_fused(graph):
    # GPT layer: QKV, projection, FC1, FC2 weights and biases, two norms' weight and bias: 12
    fused = TrainingSpec(global_batch_size=4)
    unfused = TrainingSpec(global_batch_size=4, gradient_accumulation_fusion=False)
    assert _adds_per_layer(graph, "megatron_core_te", unfused) == [12]
    assert _adds_per_layer(graph, "megatron_core_te", fused) == [8]
    assert _adds_per_layer(graph, "megatron_core_local", unfused) == [12]
    assert _adds_per_layer(graph, "megatron_deepspeed_2023", unfused) == [0]  # not Megatron-Core's DDP


def test_megatron_fsdp_copies_into_its_sharded_bucket_and_torch_fsdp2_has_no_hook(graph):
    def fsdp(**settings) -> TrainingSpec:
        return TrainingSpec(global_batch_size=4, gradient_accumulation_fusion=False, fsdp=FsdpSettings(**settings))

    zero3 = fsdp(sharding_strategy="optim_grads_params")
    assert _adds_per_layer(graph, "megatron_core_te", zero3, COPY_OP) == [12]
    assert _adds_per_layer(graph, "megatron_core_te", zero3) == [0]
    assert _adds_per_layer(graph, "megatron_core_te", fsdp(sharding_strategy="optim")) == [12]  # unsharded: adds
    fsdp2 = fsdp(implementation="torch")
    assert _adds_per_layer(graph, "megatron_core_te", fsdp2) == [0]
    assert _adds_per_layer(graph, "megatron_core_te", fsdp2, COPY_OP) == [0]


def test_a_copy_reads_the_gradient_and_writes_main_grad_once():
    block = _block()
    copies = GradHooks(fused_weights=True, grad=Dtype.BF16, main_grad=Dtype.FP32, copies=True)
    adds = grad_hook_adds(block.nodes, block, copies)[len(block.nodes):]
    assert [n.op for n in adds] == [COPY_OP] * 3
    assert [n.nbytes for n in adds] == [6 * 1536, 6 * 512, 6 * 1000]  # 2 bytes read, 4 written


def test_the_flag_turns_the_fusion_off():
    argv = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --micro-batch-size 1 --global-batch-size 4 "
            "--seq-length 64 --max-position-embeddings 64 --vocab-size 512 --bf16")
    cluster = cluster_for_gpu("h100-sxm")
    assert run_config_from_megatron_args(argv, gpus=2, cluster=cluster, source="t").training.gradient_accumulation_fusion
    assert not run_config_from_megatron_args(argv + " --no-gradient-accumulation-fusion", gpus=2, cluster=cluster,
                                             source="t").training.gradient_accumulation_fusion


def test_blocks_of_one_node_tuple_and_other_parameters_lower_apart(graph):
    # The trace cache hands equal node tuples out as one (vtrain_plugin/capture/disk_cache.py): the
    # parameters the hooks read still tell two blocks' lowerings apart.
    training = TrainingSpec(global_batch_size=4, gradient_accumulation_fusion=False)
    stage = graph.stages[0]
    fewer = tuple(replace(b, parameter_numels=b.parameter_numels[:-1],
                          num_parameters=b.num_parameters - b.parameter_numels[-1])
                  if b.kind is BlockKind.LAYER else b for b in stage.blocks)
    other = replace(graph, stages=(replace(stage, blocks=fewer),))
    assert [b.nodes for b in other.stages[0].blocks] == [b.nodes for b in stage.blocks]
    assert _adds_per_layer(graph, "megatron_core_te", training) == [12]
    assert _adds_per_layer(other, "megatron_core_te", training) == [11]
