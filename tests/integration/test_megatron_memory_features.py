"""Weights, gradients and optimizer state per GPU of real traced models with MoE (shared experts,
a layer pattern, expert parallelism and the distributed optimizer's expert-data-parallel shards),
multi-latent attention and multi-token prediction, against Megatron-LM's own
``compute_weight_and_optimizer_memory`` (the reference function, on the same arguments).

Where they agree the test asserts equality to the float's rounding; where vtrain counts what the
traced model holds and the formula does not, the difference is written out and checked exactly:

* multi-latent attention under tensor parallelism: megatron-core keeps the query and key/value down
  projections and the two latent norms whole on every TP rank (``parallel_mode="duplicated"``); the
  formula divides them by ``t`` with the rest of the attention;
* multi-token prediction: the formula counts each MTP layer as a transformer layer and omits its
  embedding and hidden norms, its final norm and its ``2h -> h`` projection (``3 h + 2 h^2`` per
  layer with RMSNorm), which megatron-core's ``MultiTokenPredictionLayer`` builds.

The formula has no hybrid (Mamba) branch (Megatron-LM prints "not yet supported"), and sliding
windows and attention sinks change no weight beyond the sink's one logit per head, so neither is
compared here.
"""

import pytest

from tests.support.megatron_reference import megatron_args, weight_and_optimizer_bytes
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

GIB = 2**30
ROUNDING = 1e-12
H, HEADS, GROUPS, FFN, SEQ = 256, 8, 2, 512, 128
LLAMA = dict(family="llama", hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, seq_length=SEQ,
             vocab_size=1000, dtype="bf16")
LLAMA_ARGS = dict(hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, seq_length=SEQ, swiglu=True,
                  normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                  padded_vocab_size=1024)


def states_bytes(model: ModelSpec, plan: ParallelPlan, *, distributed_optimizer: bool) -> float:
    """vtrain's weights, gradients and optimizer state on the first pipeline rank, in bytes."""
    training = TrainingSpec(global_batch_size=plan.data_parallel * plan.micro_batch_size,
                            distributed_optimizer=distributed_optimizer)
    memory = estimate(trace(model, plan), cluster=get_cluster_preset("dgx-h100"), training=training).memory_gib[0]
    return (memory.weights_gib + memory.gradients_gib + memory.optimizer_gib) * GIB


def test_moe_with_shared_experts_a_layer_pattern_and_expert_parallel_shards():
    model = ModelSpec(**LLAMA, num_layers=4, num_query_groups=GROUPS, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=256, moe_layer_freq=(0, 1, 1, 1))
    plan = ParallelPlan(data_parallel=4, expert_parallel=2)
    args = megatron_args(**LLAMA_ARGS, num_layers=4, group_query_attention=True, num_query_groups=GROUPS,
                         num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
                         moe_shared_expert_intermediate_size=256, moe_layer_freq=[0, 1, 1, 1], world_size=4,
                         data_parallel_size=4, expert_model_parallel_size=2, use_distributed_optimizer=True)
    assert states_bytes(model, plan, distributed_optimizer=True) == pytest.approx(
        weight_and_optimizer_bytes(args), rel=ROUNDING)


def test_multi_latent_attention_with_a_query_rank():
    mla = dict(q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)
    model = ModelSpec(**LLAMA, num_layers=2, multi_latent_attention=True, **mla)
    args = megatron_args(**LLAMA_ARGS, num_layers=2, multi_latent_attention=True, **mla)
    assert states_bytes(model, ParallelPlan(), distributed_optimizer=False) == pytest.approx(
        weight_and_optimizer_bytes(args), rel=ROUNDING)


def test_multi_latent_attention_keeps_its_down_projections_whole_under_tensor_parallelism():
    mla = dict(q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)
    model = ModelSpec(**LLAMA, num_layers=2, multi_latent_attention=True, **mla)
    args = megatron_args(**LLAMA_ARGS, num_layers=2, multi_latent_attention=True, tensor_model_parallel_size=2, **mla)
    replicated = H * 64 + H * (32 + 16) + 64 + 32  # q down, kv down with the rotary key, the latent norms
    extra_per_rank = 2 * replicated * (1 - 1 / 2)  # 2 layers; the formula gives each rank half of them
    assert states_bytes(model, ParallelPlan(tensor_parallel=2), distributed_optimizer=False) == pytest.approx(
        weight_and_optimizer_bytes(args) + 18 * extra_per_rank, rel=ROUNDING)


def test_multi_token_prediction_adds_the_norms_and_projection_the_formula_omits():
    model = ModelSpec(**LLAMA, num_layers=2, num_query_groups=GROUPS, mtp_num_layers=1)
    args = megatron_args(**LLAMA_ARGS, num_layers=2, group_query_attention=True, num_query_groups=GROUPS,
                         mtp_num_layers=1)
    omitted = 3 * H + 2 * H * H  # enorm, hnorm, final norm (RMSNorm: h each) and eh_proj
    assert states_bytes(model, ParallelPlan(), distributed_optimizer=False) == pytest.approx(
        weight_and_optimizer_bytes(args) + 18 * omitted, rel=ROUNDING)
