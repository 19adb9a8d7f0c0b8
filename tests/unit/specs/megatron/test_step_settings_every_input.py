"""The step and fusion settings (``training.unfused_kernels``, ``nan_checks``, ``per_token_loss``,
``manual_gc``, the router's load balancing) read alike from Megatron-LM flags, a Megatron-Bridge
ConfigContainer and a megatron-core TransformerConfig of the same run."""

import copy
from pathlib import Path

import pytest
import torch.nn.functional as F
import yaml
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_adapters.config_map import model_spec_from_transformer_config, training_fields_of_transformer_config
from vtrain_plugin.runs import bridge_run, run_config_from_megatron_args
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.model import LoadBalancing

from tests.integration.test_one_input_reader import FLAGS

BRIDGE = yaml.safe_load((Path(__file__).resolve().parents[3] / "fixtures" / "bridge" /
                         "gpt_tiny_run_config.yaml").read_text())
FUSIONS = {"bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
           "masked_softmax_fusion": False}


def bridge(**sections):
    data = copy.deepcopy(BRIDGE)
    for section, fields in sections.items():
        data[section].update(fields)
    return bridge_run(data, gpus=8).training


@pytest.mark.parametrize("sections, flags", [
    ({}, ""),
    ({"model": FUSIONS},
     "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-masked-softmax-fusion"),
    ({"model": {"bias_activation_fusion": False, "gated_linear_unit": False,
                "activation_func": {"_target_": "torch.nn.functional.gelu", "_call_": False}}},
     "--no-bias-gelu-fusion"),
    ({"model": {"bias_activation_fusion": False, "use_te_activation_func": True}},
     "--no-bias-swiglu-fusion --use-te-activation-func"),
    ({"ddp": {"check_for_nan_in_grad": False}}, "--no-check-for-nan-in-loss-and-grad"),
    ({"model": {"calculate_per_token_loss": True}, "train": {"manual_gc": True, "manual_gc_interval": 100}},
     "--calculate-per-token-loss --manual-gc --manual-gc-interval 100"),
])
def test_a_bridge_config_and_its_flags_give_one_training_spec(sections, flags):
    gelu = "gelu" in str(sections)
    argv = FLAGS.replace("--swiglu ", "") if gelu else FLAGS
    expected = run_config_from_megatron_args(f"{argv} {flags}", gpus=8).training
    assert bridge(**sections) == expected


def test_the_bridge_fusion_fields_reach_the_training_spec():
    assert bridge(model=FUSIONS).unfused_kernels == ("bias_activation", "bias_dropout", "masked_softmax", "rope")
    assert bridge(model={"bias_activation_fusion": False, "use_te_activation_func": True}).unfused_kernels == ()
    assert not bridge(ddp={"check_for_nan_in_grad": False}).nan_checks
    assert bridge().nan_checks  # the fixture's check_for_nan_in_grad: true


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --vocab-size 128"


def megatron_lm_config(flags: str) -> TransformerConfig:
    """The TransformerConfig Megatron-LM builds from ``flags`` (core_transformer_config_from_args): the
    fusion fields from their switches, bias_activation_fusion from --no-bias-swiglu-fusion with
    --swiglu and from --no-bias-gelu-fusion otherwise, off without a linear bias unless SwiGLU. The
    fusions are set once the config is built: its checks want TransformerEngine, which this venv lacks."""
    words = flags.split()
    swiglu, bias = "--swiglu" in words, "--disable-bias-linear" not in words
    gelu_fusion = "--no-bias-gelu-fusion" not in words and bias
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, add_bias_linear=bias, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu, calculate_per_token_loss="--calculate-per-token-loss" in words)
    config.bias_activation_fusion = "--no-bias-swiglu-fusion" not in words if swiglu else gelu_fusion
    config.bias_dropout_fusion = "--no-bias-dropout-fusion" not in words
    config.apply_rope_fusion = "--no-rope-fusion" not in words
    config.masked_softmax_fusion = "--no-masked-softmax-fusion" not in words
    config.use_te_activation_func = "--use-te-activation-func" in words
    return config


@pytest.mark.parametrize("flags", [
    "", "--swiglu", "--disable-bias-linear", "--swiglu --disable-bias-linear --no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion --no-rope-fusion", "--swiglu --no-bias-dropout-fusion --no-masked-softmax-fusion",
    "--swiglu --no-bias-swiglu-fusion --use-te-activation-func", "--no-bias-gelu-fusion --use-te-activation-func",
    "--swiglu --no-bias-swiglu-fusion --use-te-activation-func --transformer-impl local",
    "--calculate-per-token-loss --no-bias-dropout-fusion",
])
def test_a_transformer_config_and_its_flags_give_one_training_spec(flags):
    training = megatron_plan(read_command_line(f"{BASE} {flags}"), gpus=1).training
    fields = training_fields_of_transformer_config(megatron_lm_config(flags),
                                                   local_spec="--transformer-impl local" in flags)
    assert fields == {"unfused_kernels": training.unfused_kernels, "per_token_loss": training.per_token_loss}


def test_a_bare_transformer_config_runs_every_jit_fusion_off():
    # megatron-core's own defaults: every fusion field False
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert training_fields_of_transformer_config(config) == {
        "unfused_kernels": ("bias_activation", "bias_dropout", "masked_softmax", "rope"), "per_token_loss": False}


MOE = f"{BASE} --num-experts 4 --moe-router-topk 2 --global-batch-size 8"


@pytest.mark.parametrize("given, traced", [
    *((b.value, b.value) for b in LoadBalancing), ("none", "aux_loss"), ("aux_loss seq_aux_loss", "aux_loss")])
def test_the_load_balancing_the_flag_table_names_is_traced(given, traced):
    # vtrain flags: one type alone traced as given; 'none' or several summed as aux_loss, with a warning
    plan = megatron_plan(read_command_line(f"{MOE} --moe-router-load-balancing-type {given}"), gpus=1)
    assert plan.model.moe_router_load_balancing_type == traced
    assert (given == traced) == (plan.warning is None)
    types = given.split()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                               moe_router_topk=2, add_bias_linear=False,
                               moe_router_load_balancing_type=types if len(types) > 1 else given,
                               moe_aux_loss_coeff=[1e-2] * len(types) if len(types) > 1 else 1e-2)
    assert model_spec_from_transformer_config(config, vocab_size=128, seq_length=32).moe_router_load_balancing_type \
        == traced


def test_the_flag_table_names_every_traced_load_balancing():
    from vtrain_plugin.specs.megatron.model import FLAG_NOTES

    note = FLAG_NOTES["--moe-router-load-balancing-type"]
    assert all(b.value in note for b in LoadBalancing) and "'none' or several types" in note
