"""Selective recompute of each of megatron-core's recompute_modules on real traces: the recomputed
module's forward ops run again in the recompute phase, the activations it saved are dropped; the
estimate takes longer and keeps fewer activations. The Megatron-LM flags, a TransformerConfig and a
plan file name the same modules."""

import dataclasses
from collections import Counter

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.plan_file import parse_plan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

S = 256
DENSE = ModelSpec(family="llama", num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
                  seq_length=S, vocab_size=256, dtype="bf16")
MOE = dataclasses.replace(DENSE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
                          moe_shared_expert_intermediate_size=128, moe_grouped_gemm=True)
TRAINING = TrainingSpec(global_batch_size=8, software_stack=SoftwareStack.MEGATRON_CORE_TE)
CLUSTER = get_cluster_preset("dgx-h100")


def selective(*modules: str) -> ParallelPlan:
    return ParallelPlan(recompute="selective", recompute_modules=modules)


def layer(model: ModelSpec, plan: ParallelPlan):
    return trace(model, plan).stage(0).layer_template()


def ops(block, phase: Phase, module: str) -> Counter:
    """(op, input shapes) of the layer's ops in ``phase`` whose module ends with ``module``."""
    return Counter((n.op, n.key.input_shapes) for n in block.ops(phase) if n.module.endswith(module))


def test_mlp_recompute_runs_the_dense_mlp_again_and_drops_what_it_saved():
    off, on = layer(DENSE, ParallelPlan()), layer(DENSE, selective("mlp"))
    for module in ("mlp.linear_fc1", "mlp.linear_fc2", "layers.0.mlp"):
        assert ops(on, Phase.RECOMPUTE, module) == ops(off, Phase.FORWARD, module) != Counter()
    assert ops(on, Phase.RECOMPUTE, "core_attention") == Counter()  # only what was asked
    saved_off, saved_on = dict(off.saved_by_module), dict(on.saved_by_module)
    assert all(m not in saved_on for m in saved_off if ".mlp" in m)
    # the checkpoint keeps the MLP's input (s b h bf16), attributed to the layer
    assert saved_on["decoder.layers.0"] == S * 128 * 2
    assert on.activation_nbytes < off.activation_nbytes


def test_layernorm_recompute_reruns_both_norms_and_frees_their_outputs():
    off, on = layer(DENSE, ParallelPlan()), layer(DENSE, selective("layernorm"))
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        assert ops(on, Phase.RECOMPUTE, norm) == ops(off, Phase.FORWARD, norm) != Counter()
    saved = dict(on.saved_by_module)
    # the linears reading a norm's output keep it only as a freed storage (CheckpointWithoutOutput)
    assert saved["decoder.layers.0.self_attention.linear_qkv"] == saved["decoder.layers.0.mlp.linear_fc1"] == 0
    assert on.activation_nbytes < off.activation_nbytes


@pytest.mark.parametrize("module, recomputed", [
    ("moe", (".router", ".shared_experts", ".local_experts.0.linear_fc1", ".local_experts.3.linear_fc2")),
    ("shared_experts", (".shared_experts.linear_fc1", ".shared_experts.linear_fc2")),
])
def test_moe_and_shared_expert_recompute(module, recomputed):
    off, on = layer(MOE, ParallelPlan()), layer(MOE, selective(module))
    for name in recomputed:
        assert ops(on, Phase.RECOMPUTE, name) == ops(off, Phase.FORWARD, name) != Counter()
    if module == "shared_experts":
        assert ops(on, Phase.RECOMPUTE, ".router") == Counter()
    assert on.activation_nbytes < off.activation_nbytes


def test_moe_act_recompute_reruns_each_experts_activation_only():
    """The stand-in does to SequentialMLP's experts what TEGroupedMLP does: the activation's ops again,
    FC2's saved input freed."""
    off, on = layer(MOE, ParallelPlan()), layer(MOE, selective("moe_act"))
    for e in range(4):
        expert = f"local_experts.{e}"
        assert ops(on, Phase.RECOMPUTE, expert) == ops(off, Phase.FORWARD, expert) != Counter()
        assert ops(on, Phase.FORWARD, expert) == ops(off, Phase.FORWARD, expert)
        assert ops(on, Phase.RECOMPUTE, f"{expert}.linear_fc1") == Counter()
        assert dict(on.saved_by_module)[f"decoder.layers.0.mlp.experts.{expert}.linear_fc2"] == 0
    assert on.activation_nbytes < off.activation_nbytes


@pytest.mark.parametrize("model, module", [(DENSE, "mlp"), (DENSE, "layernorm"), (MOE, "moe"),
                                           (MOE, "shared_experts"), (MOE, "moe_act")])
def test_recomputing_a_module_costs_time_and_saves_activation_memory(model, module):
    base = estimate(trace(model, ParallelPlan()), cluster=CLUSTER, training=TRAINING)
    on = estimate(trace(model, selective(module)), cluster=CLUSTER, training=TRAINING)
    assert on.breakdown_ms["recompute"] > base.breakdown_ms["recompute"] == 0
    assert on.iteration_time_ms > base.iteration_time_ms
    assert on.memory_gib[0].activations_gib < base.memory_gib[0].activations_gib


@pytest.mark.parametrize("plan, message", [
    (dict(recompute="selective", recompute_modules=["mlp", "attn_proj"]),
     "parallel.recompute_modules: 'attn_proj' is not one of core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
     "shared_experts"),
    (dict(recompute="full", recompute_modules=["mlp"]),
     "parallel.recompute_modules needs parallel.recompute selective (got full)"),
    (dict(recompute="selective", recompute_modules=[]),
     "parallel.recompute_modules is empty: selective recompute needs at least one module"),
])
def test_recompute_modules_refusals(plan, message):
    with pytest.raises(ConfigError) as exc:
        ParallelPlan(**plan)
    assert str(exc.value) == message


@pytest.mark.parametrize("model, module, message", [
    (DENSE, "mla_up_proj", "parallel.recompute_modules mla_up_proj needs model.multi_latent_attention"),
    (dataclasses.replace(MOE, moe_grouped_gemm=False), "moe_act",
     "parallel.recompute_modules moe_act needs model.moe_grouped_gemm (megatron-core recomputes the expert "
     "activation of grouped-GEMM experts only)"),
])
def test_recompute_modules_the_model_lacks_are_refused_as_megatron_core_does(model, module, message):
    with pytest.raises(ConfigError) as exc:
        selective(module).check_fits(model)
    assert str(exc.value) == message


def test_flags_transformer_config_and_plan_file_name_the_same_modules():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adapters.config_map import parallel_plan_from_transformer_config

    flags = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 256 --micro-batch-size 1 "
             "--vocab-size 256 --bf16 --swiglu --recompute-granularity selective --recompute-modules mlp layernorm")
    from_flags = megatron_plan(read_command_line(f"python pretrain_gpt.py {flags}"), gpus=1).parallel
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, recompute_granularity="selective",
                               recompute_modules=["mlp", "layernorm"])
    from_config = parallel_plan_from_transformer_config(config, None)
    from_file = parse_plan({"model": {"family": "llama", "num_layers": 2, "hidden_size": 128,
                                      "num_attention_heads": 4, "seq_length": 256},
                            "parallel": {"recompute": "selective", "recompute_modules": ["mlp", "layernorm"]},
                            "training": {"global_batch_size": 8}}).parallel
    assert from_flags.recompute_modules == from_config.recompute_modules == from_file.recompute_modules \
        == ("layernorm", "mlp")
    moe_layer = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, moe_layer_recompute=True)
    assert parallel_plan_from_transformer_config(moe_layer, None).recompute_modules == ("core_attn", "moe")


def test_recomputed_expert_activation_keeps_the_model_dtype_under_fp32_routing_probabilities():
    """The flex dispatcher hands the experts fp32 probabilities (DeepEP takes no other); with expert
    biases the recomputed activation's stand-in adds the weighted bias in place, as MLP.forward does, so
    the layer's output stays in the model dtype and the next layer traces (GPT-OSS's combination)."""
    model = dataclasses.replace(MOE, num_layers=2, add_bias_linear=True, moe_shared_expert_intermediate_size=None,
                                window_size=(63, 0), window_attn_skip_freq=2)
    plan = dataclasses.replace(selective("moe_act"), data_parallel=2, expert_parallel=2, moe_token_dispatcher="flex")
    assert estimate(trace(model, plan), cluster=CLUSTER, training=TRAINING).iteration_time_ms > 0
