"""Build one chunk of a megatron-core GPTModel from a ModelSpec and run a training step on it.

Everything megatron-specific (TransformerConfig fields, layer spec, the stage's inputs) stays in
this module; it returns plain tensors and names to the tracer. The step itself (loss, forward and
backward, mixed-precision optimizer) is training_step.py's, the one real training runs too.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch

from megatron_adapters.training_step import (AdamSettings, MicroBatch, MixedPrecisionAdamW, StepScopes,
                                             assume_finite, forward_backward)
from vtrain_plugin.core.dtypes import Dtype
from megatron_adapters.conventions import LOSS, ChunkRole, is_layer_module
from vtrain_plugin.specs.model import Activation, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute

_TORCH_DTYPES = {Dtype.FP16: torch.float16, Dtype.BF16: torch.bfloat16, Dtype.FP32: torch.float32}


def torch_dtype(dtype: Dtype) -> torch.dtype:
    return _TORCH_DTYPES[dtype]


def _squared_relu():
    from megatron.core.activations import squared_relu

    return squared_relu


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


_ACTIVATIONS = {Activation.GELU: lambda: torch.nn.functional.gelu, Activation.SILU: lambda: torch.nn.functional.silu,
                Activation.SQUARED_RELU: _squared_relu, Activation.QUICK_GELU: _quick_gelu}


def transformer_config(model: ModelSpec, plan: ParallelPlan, *, layers_per_chunk: int):
    """The TransformerConfig of ``model`` under ``plan``, with ``layers_per_chunk`` layers per chunk.

    Building fewer layers than the model has is how the tracer keeps its cost independent of depth:
    every layer of a chunk is built from the same spec, so a traced chunk of two layers (verified
    identical) stands for a chunk of any number of them.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = torch_dtype(model.dtype)
    recompute: dict = {}
    if plan.recompute is Recompute.FULL:
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif plan.recompute is Recompute.SELECTIVE:
        # moe_act: megatron-core's config takes it only with grouped-GEMM experts, which the local spec
        # cannot build; the traced experts checkpoint their activation by a stand-in (build_chunk)
        recompute = dict(recompute_granularity="selective",
                         recompute_modules=[m for m in plan.recomputed_modules if m != "moe_act"])
    layer = model.layer
    moe: dict = {}
    if model.is_moe:
        from megatron_adapters.moe import moe_config_fields

        moe = moe_config_fields(model, plan)
    from megatron_adapters.hybrid import hybrid_config_fields  # Mamba hybrids: megatron_adapters/hybrid.py

    hybrid = hybrid_config_fields(model)
    attention = attention_config_fields(model, layers_per_chunk=layers_per_chunk, chunks=plan.num_model_chunks)
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=layers_per_chunk * plan.num_model_chunks,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        tensor_model_parallel_size=plan.tensor_parallel,
        pipeline_model_parallel_size=plan.pipeline_parallel,
        virtual_pipeline_model_parallel_size=plan.virtual_pipeline if plan.virtual_pipeline > 1 else None,
        sequence_parallel=plan.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        fp16=model.dtype is Dtype.FP16,
        bf16=model.dtype is Dtype.BF16,
        use_cpu_initialization=True,
        perform_initialization=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        normalization=layer.normalization.value,
        gated_linear_unit=layer.gated_linear_unit,
        activation_func=_ACTIVATIONS[layer.activation](),
        glu_linear_offset=model.glu_linear_offset,
        activation_func_clamp_value=model.activation_func_clamp_value,
        add_bias_linear=layer.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=layer.hidden_dropout,
        attention_dropout=layer.attention_dropout,
        qk_layernorm=model.qk_layernorm or model.multi_latent_attention,  # MLA: its latent norms
        qk_l2_norm=model.qk_l2_norm,
        **recompute,
        **moe,
        **hybrid,
        **attention,
    )


def attention_config_fields(model: ModelSpec, *, layers_per_chunk: int, chunks: int) -> dict:
    """The TransformerConfig / MLATransformerConfig fields of ``model``'s attention variants (none
    when off), for ``chunks`` chunks of ``layers_per_chunk`` layers. A model that alternates windowed
    and full layers is traced with a window on every other layer (``window_attn_skip_freq=2``: two
    consecutive layers are one of each kind, whatever the chunk's first layer number); NoPE layers
    are given per layer number (``no_rope_freq`` as a list: each chunk's traced layers are
    :func:`megatron_adapters.conventions.traced_nope_layers`); the tracer counts each kind per stage
    from the model's own pattern (:mod:`vtrain_plugin.specs.attention`)."""
    from megatron_adapters.conventions import traced_nope_layers
    from vtrain_plugin.specs.attention import mixes_nope, mixes_windows, mla_dim

    fields: dict = {}
    if model.multi_latent_attention:
        # MLA's rotary embedding is YaRN (Megatron-LM's --rope-type for MLA), whose scaling factors
        # change the frequencies' values only.
        fields.update(q_lora_rank=model.q_lora_rank, rope_type="yarn",
                      **{name: mla_dim(model, name)
                         for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")})
    if model.window_size is not None:
        fields["window_size"] = model.window_size
        fields["window_attn_skip_freq"] = 2 if mixes_windows(model) else model.window_attn_skip_freq
    if model.softmax_type != "vanilla":
        fields["softmax_type"] = model.softmax_type
    if model.mtp_num_layers is not None:
        fields["mtp_num_layers"] = model.mtp_num_layers
    if model.no_rope_freq is not None:
        fields["no_rope_freq"] = [int(nope) for nope in traced_nope_layers(layers_per_chunk, mixes_nope(model))] * chunks
    return fields


def build_chunk(model: ModelSpec, plan: ParallelPlan, role: ChunkRole, *, layers_per_chunk: int,
                layer_kinds: tuple[bool, ...] | None = None):
    """Build the GPTModel chunk of ``role`` (call inside fake_world and FakeTensorMode); with
    ``layer_kinds``, one layer per entry, a MoE layer where it is True and a dense one where False
    (a model whose moe_layer_freq mixes them), else ``layers_per_chunk`` layers of the model's kind;
    a Mamba hybrid's MambaModel chunk (:mod:`megatron_adapters.hybrid`, one layer of each kind)."""
    if model.is_hybrid:
        from megatron_adapters.hybrid import build_hybrid_chunk

        return build_hybrid_chunk(model, plan, role)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_adapters.norms import SequenceParallelNorm

    config = transformer_config(model, plan, layers_per_chunk=layers_per_chunk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model.multi_latent_attention:  # TE's core-attention signature: a stand-in (stand_ins.py)
            from megatron_adapters.stand_ins import mla_layer_spec

            layer = mla_layer_spec(normalization=model.layer.normalization.value, qk_layernorm=True)  # latent norms
        else:
            layer = get_gpt_layer_local_spec(normalization=model.layer.normalization.value,
                                             qk_layernorm=model.qk_layernorm, qk_l2_norm=model.qk_l2_norm)
        layer.submodules.input_layernorm = SequenceParallelNorm
        layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
        if model.qk_layernorm and not model.multi_latent_attention:  # torch's norm refuses SP, which QK norms never see
            layer.submodules.self_attention.submodules.q_layernorm = SequenceParallelNorm
            layer.submodules.self_attention.submodules.k_layernorm = SequenceParallelNorm
        if model.qk_l2_norm:
            from megatron_adapters.norms import EagerL2Norm

            layer.submodules.self_attention.submodules.q_layernorm = EagerL2Norm
            layer.submodules.self_attention.submodules.k_layernorm = EagerL2Norm
        layers = [layer] * layers_per_chunk
        if model.is_moe:
            from megatron_adapters.moe import moe_layer_spec

            moe_layer = copy.deepcopy(layer)
            moe_layer.submodules.mlp = moe_layer_spec(model)
            kinds = layer_kinds if layer_kinds is not None else (True,) * layers_per_chunk
            layers = [moe_layer if moe else layer for moe in kinds]
        block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelNorm)
        mtp = None
        if model.mtp_num_layers is not None and role.post_process:  # the MTP block, on the last stage
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp = get_gpt_mtp_block_spec(config, layers[-1], use_transformer_engine=False)  # the last layer's kind
            for mtp_layer in mtp.layer_specs:  # torch's norms, which the local spec refuses under SP
                mtp_layer.submodules.enorm = mtp_layer.submodules.hnorm = SequenceParallelNorm
                mtp_layer.submodules.layer_norm = SequenceParallelNorm
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=model.padded_vocab_size(plan.tensor_parallel),
            max_sequence_length=model.seq_length,
            pre_process=role.pre_process,
            post_process=role.post_process,
            share_embeddings_and_output_weights=model.tied,
            position_embedding_type=model.layer.position_embedding_type.value,
            rotary_percent=model.rotary_percent,
            vp_stage=role.chunk if plan.virtual_pipeline > 1 else None,
            **({"mtp_block_spec": mtp} if mtp is not None else {}),
        )
    _cast_parameters(gpt, torch_dtype(model.dtype))
    if model.is_moe:
        from megatron_adapters.flex_routing import flex_dispatch
        from megatron_adapters.moe import prepare_moe_layers

        prepare_moe_layers(gpt, model.moe_routing_skew, flex_dispatch(model, plan))
        if "moe_act" in plan.recomputed_modules:
            from megatron_adapters.stand_ins import recompute_expert_activations

            recompute_expert_activations(gpt)
    return gpt


def _cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Megatron's Float16Module: every parameter (learned positions too) in the model dtype."""
    for p in module.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def stage_input_shape(model: ModelSpec, plan: ParallelPlan) -> tuple[int, int, int]:
    """Hidden states passed between pipeline stages: [s (/tp with SP), b, h]."""
    seq = model.seq_length // plan.tensor_parallel if plan.sequence_parallel else model.seq_length
    return (seq, plan.micro_batch_size, model.hidden_size)


def run_training_step(gpt, model: ModelSpec, plan: ParallelPlan, role: ChunkRole, recorder,
                      adam: AdamSettings = AdamSettings()) -> None:
    """Record one micro-batch's forward, loss and backward, and the optimizer step (training_step.py).

    Inputs, the gradient from the next stage and the optimizer state are created with recording
    paused: they exist before the step in a real run. The step is that of one micro-batch of an
    iteration of any length: dividing the loss by the number of micro-batches is one scalar op
    whatever the number, so the trace divides by 1.
    """
    from vtrain_plugin.core.graph import Phase

    b, s = plan.micro_batch_size, model.seq_length
    dtype = torch_dtype(model.dtype)
    with recorder.paused():
        optimizer = MixedPrecisionAdamW(gpt.parameters(), adam, found_inf=assume_finite)
        if not role.pre_process:
            gpt.set_input_tensor(torch.zeros(stage_input_shape(model, plan), dtype=dtype, requires_grad=True))
        # the token ids reach the last stage too when it holds MTP layers (they embed the next tokens)
        ids = role.pre_process or (role.post_process and model.mtp_num_layers is not None)
        batch = MicroBatch(
            tokens=torch.zeros(b, s, dtype=torch.long) if ids else None,
            position_ids=torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s) if ids else None,
            attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool),
            labels=torch.zeros(b, s, dtype=torch.long) if role.post_process else None,
            loss_mask=torch.ones(b, s, dtype=torch.float32) if role.post_process else None,
            output_grad=None if role.post_process else torch.ones(stage_input_shape(model, plan), dtype=dtype))
        _mtp_loss_tracker(model)
    global_module = _global_ops_module(optimizer.params, recorder)
    seed_module = LOSS if role.post_process else ""
    scopes = StepScopes(
        forward=lambda: recorder.phase(Phase.FORWARD),
        loss=lambda: recorder.module(LOSS),
        backward=lambda: _both(recorder.phase(Phase.BACKWARD), recorder.default_module(seed_module)),
        optimizer=lambda: recorder.phase(Phase.OPTIMIZER),
        parameter=lambda p: recorder.module(recorder.param_owner(p)),
        global_ops=lambda: recorder.module(global_module),
    )
    forward_backward(gpt, batch, num_microbatches=1, loss_scale=optimizer.loss_scale, scopes=scopes)
    optimizer.step(scopes)
    _mtp_loss_tracker(None)


def _mtp_loss_tracker(model: ModelSpec | None) -> None:
    """megatron-core's MTP loss logging keeps a process-wide buffer (``MTPLossLoggingHelper.tracker``)
    that the first step allocates and the training loop zeroes after logging: in a steady iteration it
    exists before the step. Made so before recording (``model``), dropped after (None), so every trace
    is the same and no fake tensor outlives its trace."""
    if model is None or model.mtp_num_layers is not None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.tracker.clear()
        if model is not None:
            MTPLossLoggingHelper.tracker["values"] = torch.zeros(model.mtp_num_layers)

def _global_ops_module(params, recorder) -> str:
    """The module the optimizer's global ops (found-inf reset, total norm, clip coefficient) are
    attributed to: the owner of the first parameter outside the transformer layers (the embedding
    on the first stage, the final norm on the last), or the stage itself (``""``) on a stage of
    layers only.

    Their cost lands in a block the stage has anyway (a stage of layers only has a stage block:
    autograd seeds the output gradient there), so no block of their own appears in the graph. Not
    in a layer, though the first parameter's owner is one on every stage but the first: that layer
    would then differ from the others, and the traced layers would no longer fold into one template.
    """
    for p in params:
        owner = recorder.param_owner(p)
        if not is_layer_module(owner):
            return owner
    return ""


@contextlib.contextmanager
def _both(first, second) -> Iterator[None]:
    with first, second:
        yield


class _LanguageModelLoss(torch.nn.Module):
    """GPTModel computes its vocab-parallel cross-entropy in a method; as a module, it gets a name."""

    def __init__(self, compute) -> None:
        super().__init__()
        self.compute = compute

    def forward(self, labels, logits):
        return self.compute(labels, logits)


def prepare_for_recording(gpt) -> None:
    """Route ``gpt.compute_language_model_loss`` through a submodule named ``loss`` (this instance only).

    The name is :data:`megatron_adapters.conventions.LOSS`, which tracing counts in the head. Call before
    attaching the recorder, so the new module gets its hooks.
    """
    if not getattr(gpt, "post_process", False) or LOSS in gpt._modules:
        return
    loss = _LanguageModelLoss(gpt.compute_language_model_loss)
    setattr(gpt, LOSS, loss)
    object.__setattr__(gpt, "compute_language_model_loss", loss)
