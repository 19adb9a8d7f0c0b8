"""The model FLOPs of a ModelSpec as Megatron-LM counts them: ``num_floating_point_operations``
(``megatron/training/training.py``), the count behind the TFLOP/s of Megatron's log line and its MFU.

Forward and backward are 3 GEMMs per weight (forward, data gradient, weight gradient), 2 FLOPs per
multiply-add, so ``6 T`` per weight-like term over ``T = sequences x s`` tokens:

* attention, per layer: ``6 T (h (q + 2 k) + q h)`` for the projections (``q = kv_channels x
  heads``, ``k = kv_channels x query groups``) and ``6 B s^2 q`` for the score and context products
  under the causal mask (half the square, times the two products); MLA: its down/up projections,
  norms and rotary key, ``6 T (q_term + kv_lora (h + n (qk + v) + 1) + h rope + n v h)`` with
  ``q_term = q_lora (h + n (qk + rope) + 1)`` (``h n (qk + rope)`` without a query rank), and
  ``3 B s^2 n (qk + rope + v)``;
* MLP: ``6 T h f x (3 if gated else 2) / 2`` per dense layer, and per MoE layer the same with
  ``topk x`` the expert FFN plus the shared experts' FFN;
* multi-token prediction: each MTP layer is a layer of the last layer's kind, with
  ``6 T (3 h + 2 h^2)`` for its norms and projection and one more logits product;
* logits: ``6 T h V`` over the padded vocabulary (128 x TP);
* a Mamba hybrid: Megatron's hybrid branch (attention ``4 T h p (h + h g / n) + 2 B s^2 h p`` with
  ``p = kv_channels n / h``, MLP ``4 T h f`` x 3/2 gated, MoE the same over ``topk`` x the expert FFN
  plus the shared experts' FFN, Mamba ``2 T h (2 d + 2 G N + H) + 7 T d N
  + 2 T d h`` with Megatron's ``d = 2 h``, logits once per MTP layer and the model's), times 3.

Why Megatron's count and not the traced kernels': MFU is then the quantity Megatron logs (the
traced FLOPs count what runs, e.g. flash attention's backward at 2.5x its forward and recompute;
those are the estimate's hardware FLOPs). Like Megatron's, the count ignores sliding windows,
attention sinks, norms, activations and the router: a model's MFU does not depend on them.
Megatron's ``--swiglu`` is :attr:`LayerChoices.gated_linear_unit` here (a gated MLP has three GEMMs
whatever its activation). Every term is an integer, so the count is exact.
"""

from __future__ import annotations

from vtrain_plugin.specs import hybrid
from vtrain_plugin.specs.attention import mla_dim
from vtrain_plugin.specs.model import ModelSpec

FORWARD_BACKWARD = 3  # forward, data-gradient and weight-gradient GEMM per weight
FMA = 2  # FLOPs per multiply-add


def megatron_model_flops(model: ModelSpec, *, sequences: int, tensor_parallel: int = 1) -> int:
    """FLOPs of forward and backward of ``sequences`` sequences of ``model.seq_length`` tokens
    (a global batch: Megatron-LM's ``num_floating_point_operations(args, batch_size=sequences)``);
    ``tensor_parallel`` sets the padded vocabulary."""
    if model.is_hybrid:
        return FORWARD_BACKWARD * hybrid_forward_flops(model, sequences=sequences, tensor_parallel=tensor_parallel)
    return _transformer_flops(model, sequences=sequences, tensor_parallel=tensor_parallel)


def _transformer_flops(model: ModelSpec, *, sequences: int, tensor_parallel: int) -> int:
    s, h = model.seq_length, model.hidden_size
    tokens = sequences * s
    pattern = model.moe_layer_pattern
    moe_layers = sum(pattern)
    dense_layers = model.num_layers - moe_layers
    mtp = model.mtp_num_layers or 0
    if pattern[-1]:  # MTP layers are of the last layer's kind
        moe_layers += mtp
    else:
        dense_layers += mtp
    layers = model.num_layers + mtp
    ffn_gemms = 3 if model.layer.gated_linear_unit else 2
    shared = model.moe_shared_expert_intermediate_size or 0
    mlp = h * (model.ffn_size * ffn_gemms * dense_layers
               + (model.expert_ffn_size * model.router_topk + shared) * ffn_gemms * moe_layers)
    projections, core_per_token_pair = attention_terms(model)
    mtp_extra = mtp * (3 * h + 2 * h * h)  # the MTP embedding and hidden norms, final norm; its projection
    logits = h * model.padded_vocab_size(tensor_parallel) * (mtp + 1)
    linear = FORWARD_BACKWARD * FMA * (mlp + projections * layers + mtp_extra + logits)
    return tokens * linear + sequences * s * s * core_per_token_pair * layers


def attention_terms(model: ModelSpec) -> tuple[int, int]:
    """One layer's attention: (weight-like elements per token, multiplied by 6 per token; core
    attention FLOPs per (sequence, query, key) pair, forward and backward, causal)."""
    h, n = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:
        qk, rope, v, kv = (mla_dim(model, name) for name in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                                           "kv_lora_rank"))
        q_term = h * n * (qk + rope) if model.q_lora_rank is None else model.q_lora_rank * (h + n * (qk + rope) + 1)
        projections = q_term + kv * (h + n * (qk + v) + 1) + h * rope + n * v * h
        # 6 x (n (qk + rope) / 2 + n v / 2): the causal half of the score and context products
        return projections, FORWARD_BACKWARD * n * (qk + rope + v)
    q = model.head_dim * n
    k = model.head_dim * model.query_groups
    # 6 x q / 2 (causal half) x 2 (scores and context)
    return h * (q + 2 * k) + q * h, FORWARD_BACKWARD * FMA * q


def hybrid_forward_flops(model: ModelSpec, *, sequences: int, tensor_parallel: int = 1) -> int:
    """FLOPs of one forward of ``sequences`` sequences through a Mamba hybrid: Megatron-LM's
    ``hybrid_flops`` before its factor 3."""
    assert model.hybrid_layer_pattern is not None
    counts = hybrid.layer_counts(model.hybrid_layer_pattern)
    s, h = model.seq_length, model.hidden_size
    tokens = sequences * s
    n, g, d = model.num_attention_heads, model.query_groups, model.head_dim
    # 4 T h p (h + h g / n) + 2 B s^2 h p with p = d n / h
    attention = 4 * tokens * d * (n * h + h * g) + 2 * sequences * s * s * d * n
    gemms = 3 if model.layer.gated_linear_unit else 2
    mlp = 2 * tokens * h * model.ffn_size * gemms
    moe = 2 * tokens * h * (model.expert_ffn_size * model.router_topk
                            + (model.moe_shared_expert_intermediate_size or 0)) * gemms
    d_in = hybrid.EXPAND * h  # Megatron's formula, whatever mamba_num_heads says
    heads = model.mamba_num_heads or d_in // model.mamba_headdim
    mamba = (2 * tokens * h * (2 * d_in + 2 * model.mamba_groups * model.mamba_state + heads)
             + 7 * tokens * d_in * model.mamba_state + 2 * tokens * d_in * h)
    logits = 2 * tokens * h * model.padded_vocab_size(tensor_parallel) * (1 + (model.mtp_num_layers or 0))
    return (counts[hybrid.ATTENTION] * attention + counts[hybrid.MLP] * mlp + counts[hybrid.MOE] * moe
            + counts[hybrid.MAMBA] * mamba + logits)
