"""A layer feature gets the same answer on every input path: Megatron-LM arguments, a megatron-core
TransformerConfig (the real one) and a plan file (vtrain_plugin.specs.model_features)."""

import dataclasses
import logging

import pytest
import torch
from megatron.core.activations import squared_relu

from megatron_adapters.config_map import model_spec_from_transformer_config
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.launch_script import launch_command
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.plan_file import parse_plan

DIMS = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000 --micro-batch-size 1"
SWIGLU = ("--swiglu --position-embedding-type rope --normalization RMSNorm --disable-bias-linear --hidden-dropout 0 "
          "--attention-dropout 0")
GPT = dict(activation_func=torch.nn.functional.gelu)
LLAMA = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
PLAN = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                  "vocab_size": 1000, "ffn_hidden_size": 256},
        "parallel": {}, "training": {"global_batch_size": 1}}


def from_args(flags: str):
    return megatron_plan(launch_command(f"{DIMS} {flags}".split()), gpus=1)


def from_config(caplog, **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                  "ffn_hidden_size": 256, **fields})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_adapters.config_map"):
        model = model_spec_from_transformer_config(config, vocab_size=1000, seq_length=32)
    return model, [r.getMessage() for r in caplog.records]


def same(model):
    """``model`` with query groups spelled out, tying and dtype aside (a bare config names neither)."""
    return dataclasses.replace(model, num_query_groups=model.query_groups, tied_embeddings=True, dtype="fp32")


def refusal(call) -> str:
    """What is refused, without the name the input path gives it."""
    with pytest.raises(ConfigError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message.split(": ", 1)[1]


@pytest.mark.parametrize("flags, config, plan_key, plan_value, what", [
    ("--softmax-type off-by-one", dict(GPT, softmax_type="off-by-one"), "softmax_type", "off-by-one",
     "an off-by-one softmax"),
    ("--fp32-residual-connection", dict(GPT, fp32_residual_connection=True), "fp32_residual_connection", True,
     "a residual stream in fp32"),
    ("--position-embedding-type yarn", None, "position_embedding_type", "yarn", "YaRN rotary embeddings"),
])
def test_a_refused_feature_is_refused_alike_on_every_path(caplog, flags, config, plan_key, plan_value, what):
    """Regression: --window-size was accepted with a warning while TransformerConfig.window_size was refused
    (windows are modelled now: tests/integration/test_attention_estimates.py)."""
    expected = f"{what} is not modelled by vtrain yet"
    assert refusal(lambda: from_args(flags)) == expected
    if config is not None:  # the position embedding is a GPTModel argument, not a config field
        assert refusal(lambda: from_config(caplog, **config)) == expected
    if plan_key is not None:  # a plan file's layers have linear biases by family only
        plan = {**PLAN, "model": {**PLAN["model"], plan_key: plan_value}}
        assert refusal(lambda: parse_plan(plan)) == expected
        off = {**PLAN, "model": {**PLAN["model"], plan_key: None}}
        if plan_key == "position_embedding_type":
            return
        assert parse_plan(off).model == parse_plan(PLAN).model  # off: what vtrain models


@pytest.mark.parametrize("flags, config, plan_model", [
    ("--normalization RMSNorm", dict(GPT, normalization="RMSNorm"), dict(normalization="RMSNorm")),
    ("--disable-bias-linear", dict(GPT, add_bias_linear=False), dict(add_bias_linear=False)),
    ("--hidden-dropout 0.0 --attention-dropout 0.0", dict(GPT, hidden_dropout=0.0, attention_dropout=0.0),
     dict(hidden_dropout=0.0, attention_dropout=0.0)),
    (SWIGLU.replace("RMSNorm", "LayerNorm"), dict(LLAMA, normalization="LayerNorm"),
     dict(family="llama", normalization="LayerNorm")),
    (SWIGLU.replace(" --disable-bias-linear", ""), dict(LLAMA, add_bias_linear=True),
     dict(family="llama", add_bias_linear=True)),
    (f"{SWIGLU} --add-qkv-bias", dict(LLAMA, add_qkv_bias=True), dict(family="llama", add_qkv_bias=True)),
    ("--apply-layernorm-1p", dict(GPT, layernorm_zero_centered_gamma=True), dict(layernorm_zero_centered_gamma=True)),
    ("--squared-relu", dict(GPT, activation_func=squared_relu), dict(activation="squared_relu")),
    ("--kv-channels 32", dict(GPT, kv_channels=32), dict(kv_channels=32)),
    ("--qk-layernorm", dict(GPT, qk_layernorm=True), dict(qk_layernorm=True)),
    ("--qk-l2-norm", dict(GPT, qk_l2_norm=True), dict(qk_l2_norm=True)),
    (f"{SWIGLU} --no-rope-freq 2", dict(LLAMA, no_rope_freq=2), dict(family="llama", no_rope_freq=2)),
])
def test_a_layer_feature_is_the_same_model_on_every_path(caplog, flags, config, plan_model):
    """Regression: these were noted ("vtrain does not model") or refused, differently by path; each
    is now a ModelSpec field, the same on every path (so the same trace and estimate), with no note."""
    plan = from_args(flags + " --ffn-hidden-size 256")
    model, warnings = from_config(caplog, **config)
    from_file = parse_plan({**PLAN, "model": {**PLAN["model"], **plan_model}}).model
    assert same(plan.model) == same(model) == same(from_file)
    assert all(getattr(model, key) == value for key, value in plan_model.items())
    assert plan.unmodelled == () and warnings == []
