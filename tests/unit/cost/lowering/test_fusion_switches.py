"""Megatron's jit fusions turned off (``training.unfused_kernels``, Megatron-LM's ``--no-...-fusion``
switches): the kernels of a traced GPT and Llama layer with and without each, on the TE and local stacks,
and the Megatron-LM reader and ``vtrain flags`` that set and explain them."""

from __future__ import annotations

import argparse
import math

import pytest

from vtrain_plugin.cli.flags import run as flags_command
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import is_layer_root
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

TE, LOCAL = "megatron_core_te", "megatron_core_local"
ROPE_FWD = ["cos", "mul", "_to_copy", "sin", "mul", "_to_copy", "mul", "neg", "cat", "mul", "add", "cat"]
ROPE_BWD = ["mul", "neg", "cat", "mul", "add", "add"]


def _layer(family: str, sequence_parallel: bool = False):
    from vtrain_plugin.capture.tracer import trace

    model = ModelSpec(family=family, num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=256, dtype="bf16", num_query_groups=2 if family == "llama" else None)
    graph = trace(model, ParallelPlan(tensor_parallel=2, micro_batch_size=2, sequence_parallel=sequence_parallel))
    return graph.stages[0].layer_template().nodes


@pytest.fixture(scope="module")
def gpt():
    return _layer("gpt")


@pytest.fixture(scope="module")
def llama():
    return _layer("llama", sequence_parallel=True)


def ops(nodes, phase: Phase) -> list[str]:
    """The name of each kernel and collective of ``phase``, in order."""
    return [n.op.split(".")[1] if isinstance(n, OpNode) else n.kind.value for n in nodes
            if n.phase is phase and (not isinstance(n, OpNode) or n.launches_kernel)]


def _replaced(base: list[str], old: str, new: list[str]) -> list[str]:
    out: list[str] = []
    for name in base:
        out.extend(new if name == old else [name])
    return out


@pytest.mark.parametrize("stack", [TE, LOCAL])
def test_bias_gelu_off_runs_the_bias_add_and_gelu_unfused(gpt, stack):
    fused, unfused = map_nodes(gpt, stack), map_nodes(gpt, stack, unfused=("bias_activation",))
    assert ops(unfused, Phase.FORWARD) == _replaced(ops(fused, Phase.FORWARD), "bias_gelu_fused", ["add", "gelu"])
    assert ops(unfused, Phase.BACKWARD) == _replaced(ops(fused, Phase.BACKWARD), "bias_gelu_fused_backward",
                                                     ["gelu_backward"])
    assert len(ops(unfused, Phase.FORWARD)) == len(ops(fused, Phase.FORWARD)) + 1


@pytest.mark.parametrize("stack", [TE, LOCAL])
def test_bias_dropout_add_off_runs_two_adds_around_a_dropout(gpt, stack):
    fused, unfused = map_nodes(gpt, stack), map_nodes(gpt, stack, unfused=("bias_dropout",))
    forward = ops(unfused, Phase.FORWARD)
    assert forward == _replaced(ops(fused, Phase.FORWARD), "bias_dropout_add_fused_train",
                                ["add", "native_dropout", "add"])
    assert len(forward) == len(ops(fused, Phase.FORWARD)) + 4  # two per layer's attention and MLP
    assert ops(unfused, Phase.BACKWARD) == _replaced(ops(fused, Phase.BACKWARD), "bias_dropout_add_fused_train_backward",
                                                     ["native_dropout_backward"])
    dropouts = [n for n in unfused if isinstance(n, OpNode) and n.op == "aten.native_dropout.default"
                and is_layer_root(n.module)]
    assert len(dropouts) == 2 and all(n.nbytes == 5 * math.prod(n.key.input_shapes[0]) == 5 * 64 * 64
                                      for n in dropouts)  # 64 tokens x 64 wide: bf16 in and out, a byte mask


def test_swiglu_and_rope_off_keep_the_traced_ops(llama):
    fused = map_nodes(llama, TE)
    unfused = map_nodes(llama, TE, unfused=("bias_activation", "rope"))
    forward = _replaced(_replaced(ops(fused, Phase.FORWARD), "fused_rope", ROPE_FWD), "swiglu_fused",
                        ["silu", "add", "mul"])
    assert ops(unfused, Phase.FORWARD) == forward
    assert len(forward) == 16 + 2 * 11 + 2  # 12 ops for each of the queries' and keys' rotations, 3 for SwiGLU
    backward = _replaced(_replaced(ops(fused, Phase.BACKWARD), "fused_rope_backward", ROPE_BWD),
                         "swiglu_fused_backward", ["mul", "mul", "silu_backward", "cat"])
    assert ops(unfused, Phase.BACKWARD) == backward and len(backward) == 23 + 2 * 5 + 3
    only_rope = map_nodes(llama, TE, unfused=("rope",))
    assert ops(only_rope, Phase.FORWARD).count("swiglu_fused") == 1 and "fused_rope" not in ops(only_rope, Phase.FORWARD)


def test_masked_softmax_off_is_the_traced_softmax_on_the_local_stack_and_nothing_under_te(gpt):
    fused, unfused = map_nodes(gpt, LOCAL), map_nodes(gpt, LOCAL, unfused=("masked_softmax",))
    assert ops(unfused, Phase.FORWARD) == _replaced(ops(fused, Phase.FORWARD), "scaled_upper_triang_masked_softmax",
                                                    ["_to_copy", "masked_fill_", "_softmax", "_to_copy"])
    assert ops(unfused, Phase.BACKWARD) == _replaced(
        ops(fused, Phase.BACKWARD), "scaled_upper_triang_masked_softmax_backward",
        ["_to_copy", "_softmax_backward_data", "masked_fill", "_to_copy"])
    assert map_nodes(gpt, TE, unfused=("masked_softmax",)) == map_nodes(gpt, TE)
    assert map_nodes(gpt, TE, unfused_attention=True, unfused=("masked_softmax",)) == map_nodes(
        gpt, TE, unfused_attention=True)


def test_the_local_spec_stack_runs_the_traced_ops_either_way(gpt):
    assert map_nodes(gpt, "local_spec", unfused=("bias_activation", "rope")) == map_nodes(gpt, "local_spec")


def test_training_spec_checks_the_fusion_names():
    assert TrainingSpec(global_batch_size=8, unfused_kernels=["rope", "bias_dropout", "rope"]).unfused_kernels == (
        "bias_dropout", "rope")
    with pytest.raises(ConfigError, match="training.unfused_kernels must be one of"):
        TrainingSpec(global_batch_size=8, unfused_kernels=("gelu",))
    with pytest.raises(ConfigError, match="training.unfused_kernels must be a list"):
        TrainingSpec(global_batch_size=8, unfused_kernels="rope")


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --vocab-size 128 --bf16")


def _plan(flags: str):
    return megatron_plan(read_command_line(f"{BASE} {flags}"), gpus=1)


@pytest.mark.parametrize("flags, unfused", [
    ("--no-bias-gelu-fusion", ("bias_activation",)),
    ("--no-bias-gelu-fusion --swiglu", ()),  # Megatron-LM reads the SwiGLU switch with --swiglu
    ("--no-bias-swiglu-fusion --swiglu", ("bias_activation",)),
    ("--no-bias-swiglu-fusion", ()),
    ("--no-rope-fusion --no-bias-dropout-fusion", ("bias_dropout", "rope")),
    ("--no-masked-softmax-fusion --transformer-impl local", ("masked_softmax",)),
    ("--attention-softmax-in-fp32 --apply-query-key-layer-scaling --no-persist-layer-norm", ()),
])
def test_megatron_flags_set_the_unfused_kernels_without_a_warning(flags, unfused):
    plan = _plan(flags)
    assert plan.training.unfused_kernels == unfused
    assert plan.warning is None


def test_vtrain_flags_says_where_a_switch_changes_nothing(capsys):
    args = argparse.Namespace(flags=["attention-softmax-in-fp32", "no-bias-gelu-fusion", "no-rope-fusion"],
                              release=None, effect=None, format="table")
    assert flags_command(args) == 0
    out = capsys.readouterr().out
    softmax = next(line for line in out.splitlines() if line.startswith("--attention-softmax-in-fp32"))
    assert "modelled" in softmax and "no effect on megatron_core_te: TransformerEngine's attention" in softmax
    gelu = next(line for line in out.splitlines() if line.startswith("--no-bias-gelu-fusion"))
    assert "fusion_flags.py" in gelu and "no effect with --swiglu" in gelu
    rope = next(line for line in out.splitlines() if line.startswith("--no-rope-fusion"))
    assert "fusion_flags.py" in rope and "no effect" not in rope


def test_the_estimate_names_the_fusions_it_runs_unfused():
    from vtrain_plugin.specs.assumptions import training_assumptions

    te = TrainingSpec(global_batch_size=8, software_stack="megatron_core_te", unfused_kernels=("rope", "masked_softmax"))
    assert [line.split(":")[0] for line in training_assumptions(te)] == ["Megatron's fusions off (rope)"]
    local = TrainingSpec(global_batch_size=8, software_stack="megatron_core_local", unfused_kernels=("masked_softmax",))
    assert [line.split(":")[0] for line in training_assumptions(local)] == ["Megatron's fusions off (masked_softmax)"]
    assert training_assumptions(TrainingSpec(global_batch_size=8, software_stack="megatron_core_te",
                                             unfused_kernels=("masked_softmax",))) == ()
