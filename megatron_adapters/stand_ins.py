"""Stand-ins for the megatron-core layers that cannot be built or run on a CPU: all of them, in one place.

megatron-core is traced as the user's stack builds it (DESIGN.md, "The model is what megatron-core
builds"); where megatron-core 0.16 cannot build a layer on a CPU under FakeTensorMode, a stand-in
takes the place of the one piece that fails, with that piece's constructor, and runs the same math
in plain torch ops, so that every traced op carries the FLOPs and bytes of the work the GPU does.
Each stand-in says what it replaces, why, and which ops it records.

Two kinds, neither applied at import:

* **Modules for a layer spec** (nothing is patched: they are handed to megatron-core's own
  builders through the spec): :class:`CoreAttention` (TransformerEngine's ``TEDotProductAttention``
  constructor, the local spec's unfused attention, query/key and value head dims apart: multi-latent
  attention), :class:`MambaMixer` (megatron-core's ``MambaMixer`` constructor, the Mamba-2 mixer in
  torch ops) with its :class:`ChunkedScan` and :class:`GatedRMSNorm`; and the specs that use them,
  :func:`mla_layer_spec` and :func:`hybrid_stack_spec`; and :class:`ExpertActivationRecompute`, the
  class a built SequentialMLP expert is given when its activation is recomputed ("moe_act").
* **Patches scoped to tracing**, listed by :func:`stand_in_patches` and applied, with the other
  CPU stand-ins, by :func:`megatron_adapters.cpu_patches.cpu_tracing_patches` (which restores them
  on exit): multi-latent attention's belief that TransformerEngine is installed, the attention
  masks megatron-core builds with ``device="cuda"``
  (:func:`sliding_window_causal_mask`, :func:`default_causal_mask`), the TransformerEngine norm the
  Mamba stack builds for its final norm whatever its spec says (:class:`LocalNorm`), and the MoE
  router's sinkhorn, whose loop runs until a device value converges (:func:`sinkhorn`).

What is *not* here: megatron-core's ``megatron.core.ssm.mamba_mixer`` is never imported (it imports
triton at import time, and its mixer needs ``mamba_ssm`` and ``einops``), so nothing fake is put in
``sys.modules``: the hybrid spec names the stand-in mixer instead.

The private megatron-core names this module relies on, and how megatron-core 0.17-0.19 changed
them, are listed in :data:`MEGATRON_CORE_NAMES`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_adapters.norms import SequenceParallelNorm
from vtrain_plugin.core.errors import TraceError

# What this module touches in megatron-core beyond the public model classes, and what 0.17-0.19.2
# did to each (read from the 0.19.2 wheel). A newer release that changes one of them is followed here.
MEGATRON_CORE_NAMES: dict[str, str] = {
    "transformer.dot_product_attention.DotProductAttention":
        "subclassed by CoreAttention (constructor, forward, and the attributes hidden_size_per_partition "
        "and num_attention_heads_per_partition): unchanged in 0.19.2",
    "extensions.transformer_engine.TEDotProductAttention (constructor signature)":
        "mirrored by CoreAttention; forward signature too: unchanged in 0.19.2",
    "transformer.multi_latent_attention.MLASelfAttention":
        "builds core_attention with k_channels / v_channels / softmax_scale: same in 0.19.2",
    "transformer.utils.get_sliding_window_causal_mask, get_default_causal_mask":
        "both still build on device='cuda' in 0.19.2; fused_softmax still imports them by name",
    "fusions.fused_softmax (module globals of those two names)": "patched by name: unchanged in 0.19.2",
    "transformer.multi_latent_attention.HAVE_TE":
        "0.16.1 sets it True whenever extensions.transformer_engine imports (always: TE is mocked); "
        "0.19.2 imports HAVE_TE from extensions.transformer_engine (False without TE): the patch is "
        "then a no-op",
    "post_training.modelopt.layers.Linear":
        "the duplicated MLA down projections; 0.19.2 adds parallel_mode= and name= (optional) and "
        "marks duplicated weights tensor_model_parallel=False; MLA accepts it in both",
    "tensor_parallel.random.FP8GlobalStateManager, activation_recompute_forward, fp8_autocast":
        "bound from TransformerEngine when it imports, called by CheckpointWithoutOutput (the layernorm, "
        "mla_up_proj and moe_act recompute) whatever the precision; not read from 0.19.2",
    "ssm.mamba_mixer.MambaMixer (constructor)":
        "mirrored by MambaMixer. 0.19.2 drops the deprecated use_mem_eff_path / d_state / headdim / "
        "ngroups arguments, adds name=, and keeps conv1d as two parameters conv1d_weight / "
        "conv1d_bias instead of an nn.Conv1d (same sizes); accepted here either way",
    "ssm.mamba_layer.MambaLayer":
        "0.16 builds the norm as build_module(norm, config, hidden_size), 0.19.2 as "
        "norm(config=, hidden_size=, eps=); LocalNorm / SequenceParallelNorm take both; 0.19.2 "
        "drops residual_in_fp32 (fp32_residual_connection instead) and passes name= to the mixer",
    "ssm.mamba_block.MambaStack, MambaStackSubmodules, TENorm":
        "0.19.2 moves them to models.hybrid.hybrid_block (HybridStack, HybridStackSubmodules with new "
        "gdn / dsa / mla layer slots, symbols G, D, +; ssm.mamba_block re-exports the old names); the "
        "final norm is still a hard-coded TENorm, read from the defining module, which is the one "
        "patched; layers get name=, and the layer types come from HybridModel (hybrid_layer_pattern; "
        "hybrid_override_pattern deprecated but accepted)",
    "models.mamba.MambaModel":
        "0.19.2: a deprecated subclass of models.hybrid.HybridModel, same leading positional arguments",
    "models.gpt.gpt_layer_specs.get_gpt_layer_local_spec":
        "0.19.2 wraps get_gpt_layer_local_submodules; the arguments used here and the MLA submodule "
        "names are unchanged (MLASelfAttentionSubmodules adds linear_qkv_down_proj, for the hybrid "
        "stack's fused down projection only)",
    "TransformerConfig fields mamba_state_dim, mamba_head_dim, mamba_num_groups, mamba_num_heads, "
    "softmax_type, window_size, window_attn_skip_freq":
        "same in 0.19.2; 0.19.2 adds mamba_training_ssm_states_dtype (the stand-in keeps states in "
        "fp32 whatever it says)",
    "ssm.mamba_layer.MambaLayerSubmodules, ssm.mlp_layer.MLPLayer":
        "same names in 0.19.2 (MLPLayer adds add_layer_offset= and name=, passed by the stack)",
    "transformer.moe.router.sinkhorn (the module global TopKRouter.sinkhorn_load_balancing calls)":
        "imported from moe_utils by name and patched there: unchanged in 0.19.2",
    "tensor_parallel.layers.reduce_from_tensor_model_parallel_region (the module global RowParallelLinear calls)":
        "imported from mappings by name and patched there; not read from 0.19.2",
    "models.backends.LocalSpecProvider, models.gpt.moe_module_specs.get_moe_module_spec_for_backend":
        "same in 0.19.2 (the latter adds an optional use_te_activation_func)",
}


# --------------------------------------------------------------------------------------------------
# Core attention with TransformerEngine's signature
# --------------------------------------------------------------------------------------------------


class CoreAttention(DotProductAttention):
    """Stand-in for TransformerEngine's ``TEDotProductAttention`` (the core attention of the TE spec).

    Replaces: the core attention of a layer whose attention calls it with TE's constructor, above
    all multi-latent attention (``MLASelfAttention`` passes ``k_channels`` = qk_head_dim +
    qk_pos_emb_head_dim, ``v_channels`` = v_head_dim and its own ``softmax_scale``).
    Why: TransformerEngine cannot be installed on a CPU machine, and the local spec's
    ``DotProductAttention``, which MLA's local spec names, takes no ``k_channels`` (megatron-core
    0.16.1 and 0.19.2 alike), so ``get_gpt_layer_local_spec(multi_latent_attention=True)`` cannot build.
    Ops: exactly the local spec's unfused attention (megatron-core's ``DotProductAttention.forward``
    runs): ``baddbmm`` of queries and keys over the query/key head dim, the masked softmax (and the
    sliding window or attention sink when configured), dropout, ``bmm`` with the values over the
    value head dim. Only the output width differs: heads x ``v_channels``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, num_splits: int | None = None,
                 cp_comm_type: str | None = "p2p", pg_collection=None) -> None:
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        if softmax_scale is None:  # TE's default: 1 / sqrt(query/key head dim)
            softmax_scale = 1.0 / math.sqrt(self.k_channels)
        # num_splits splits the keys of decode-time flash attention: no training work.
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # DotProductAttention sizes its output from kv_channels; the context is heads x v head dim.
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.v_channels
        self.hidden_size_per_attention_head = self.k_channels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)


def mla_layer_spec(*, normalization: str = "RMSNorm", qk_layernorm: bool = True, num_experts: int | None = None,
                   moe_grouped_gemm: bool = False, duplicated_down_projections: bool = True) -> ModuleSpec:
    """megatron-core's local layer spec with multi-latent attention, its core attention
    :class:`CoreAttention` and its norms :class:`SequenceParallelNorm` (torch's norms, which the
    local spec refuses under sequence parallelism only for want of a parameter flag).

    ``qk_layernorm``: the RMSNorms on the compressed query and key/value latents (``--qk-layernorm``,
    which DeepSeek-V3's recipes set; the TE spec fuses them into the up projections).

    ``duplicated_down_projections``: the query and key/value down projections as the TE spec builds
    them (``TELinear``, ``parallel_mode="duplicated"``: whole on every tensor-parallel rank, no
    collective), as megatron-core's plain ``Linear`` (``post_training.modelopt.layers``), which
    MLA accepts in their place; otherwise as the local spec builds them, column parallel (split over
    TP, then all-gathered: another collective and a TP-split weight). Same at TP 1.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                    qk_layernorm=qk_layernorm, multi_latent_attention=True,
                                    normalization=normalization)
    layer = spec.submodules
    layer.input_layernorm = SequenceParallelNorm
    layer.pre_mlp_layernorm = SequenceParallelNorm
    attention = layer.self_attention.submodules
    attention.core_attention = CoreAttention
    if duplicated_down_projections:
        from megatron.core.post_training.modelopt.layers import Linear

        attention.linear_q_down_proj = Linear
        attention.linear_kv_down_proj = Linear
    if attention.q_layernorm is not IdentityOp:
        attention.q_layernorm = SequenceParallelNorm
    if attention.kv_layernorm is not IdentityOp:
        attention.kv_layernorm = SequenceParallelNorm
    return spec


# --------------------------------------------------------------------------------------------------
# Attention masks megatron-core builds on the GPU
# --------------------------------------------------------------------------------------------------


def sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """Stand-in for ``megatron.core.transformer.utils.get_sliding_window_causal_mask``.

    Replaces: the mask of sliding-window attention (``window_size``) in the local spec's softmax
    (``FusedScaleMaskSoftmax.forward_torch_softmax``), which ignores the mask it is passed and builds
    this one at every forward. Why: megatron-core builds it with ``device="cuda"``; under
    FakeTensorMode on a CPU that is a fake CUDA tensor, and masking CPU scores with it fails.
    Ops: the same as megatron-core's, on the scores' device: ``ones``, ``triu``, ``tril``, ``bitwise_not``
    of an ``[sq, skv]`` bool tensor; True marks what is masked: the future and keys more than
    ``window_size[0]`` positions back.
    """
    m = torch.ones(sq, skv, dtype=torch.bool, device=_device())
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def default_causal_mask(sq: int) -> torch.Tensor:
    """Stand-in for ``megatron.core.transformer.utils.get_default_causal_mask``: the causal mask the
    local softmax builds when a causal layer is run without one (megatron-core: ``device="cuda"``,
    as :func:`sliding_window_causal_mask`). Ops: ``ones``, ``triu``, a cast to bool."""
    return torch.triu(torch.ones(sq, sq, device=_device()), diagonal=1).bool()


def _device() -> str:
    return "cpu"


# --------------------------------------------------------------------------------------------------
# The Mamba-2 mixer
# --------------------------------------------------------------------------------------------------


@dataclass
class MambaMixerSubmodules:
    """megatron-core's ``MambaMixerSubmodules`` (which lives in ``ssm.mamba_mixer``, a module that
    imports triton): the input and output projections."""

    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


class ChunkedScan(torch.nn.Module):
    """The selective state-space scan of Mamba-2 (state space duality), chunk by chunk, as matmuls.

    Stands in for ``mamba_ssm``'s Triton kernels behind ``mamba_chunk_scan_combined`` /
    ``mamba_split_conv1d_scan_combined`` (the scan part), step for step, at the shapes they work on
    (``Q`` the chunk size, ``c`` chunks, ``h`` heads of ``p`` channels, ``g`` groups of B and C
    with state size ``n``; B and C are shared by the ``h / g`` heads of a group, as in the kernels):

    1. ``_chunk_cumsum``: ``dt = softplus(dt + dt_bias)``, ``dA = dt * A``, cumulative sum of ``dA``
       within each chunk (fp32);
    2. ``_bmm_chunk``: ``C Bᵀ`` per chunk and group, a ``[Q, n] x [n, Q]`` batched matmul;
    3. ``_chunk_scan`` (diagonal blocks): the causal decay ``exp(cumsum_l - cumsum_s)`` times ``C Bᵀ``
       times ``dt_s``, then a ``[Q, Q] x [Q, p]`` batched matmul with ``x`` per chunk and head;
    4. ``_chunk_state``: each chunk's final state, ``(x * decay * dt)ᵀ B``, a ``[hp/g, Q] x [Q, n]``
       batched matmul per chunk and group;
    5. ``_state_passing``: the recurrence over chunks, written as the ``[c+1, c+1]`` lower-triangular
       decay matrix times the states (fp32), as the minimal reference implementation of the paper
       does (the kernel runs the recurrence: ``c`` times fewer FLOPs, a negligible share);
    6. ``_chunk_scan`` (off-diagonal): ``C`` times the state entering the chunk, a ``[Q, n] x [n, hp/g]``
       batched matmul per chunk and group, scaled by ``exp(cumsum)``; plus the skip ``D * x``.

    Matmuls run in the activations' dtype and the decays in fp32, as in the kernels. A sequence that
    is not a multiple of the chunk size is padded to one (the kernels compute a partial last chunk).
    """

    def __init__(self, chunk_size: int, headdim: int, ngroups: int, d_state: int) -> None:
        super().__init__()
        self.chunk_size, self.headdim, self.ngroups, self.d_state = chunk_size, headdim, ngroups, d_state

    def forward(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """``x``: [b, l, h*p]; ``dt``: [b, l, h]; ``A``, ``dt_bias``: [h] (fp32); ``B``, ``C``:
        [b, l, g*n]; ``D``: [h] or [h*p]. Returns y: [b, l, h*p] in ``x``'s dtype."""
        b, seq, width = x.shape
        p, g, n = self.headdim, self.ngroups, self.d_state
        h = width // p
        hg = h // g
        Q = min(self.chunk_size, seq)
        pad = -seq % Q
        if pad:
            x, dt, B, C = (F.pad(t, (0, 0, 0, pad)) for t in (x, dt, B, C))
        c = (seq + pad) // Q
        dtype = x.dtype
        # 1. dt and the cumulative decay within each chunk (fp32): [b, h, c, Q]
        dt = F.softplus(dt.float() + dt_bias.float())
        dA = (dt * A.float()).view(b, c, Q, h).permute(0, 3, 1, 2)
        dA_cumsum = torch.cumsum(dA, dim=-1)
        dt = dt.view(b, c, Q, h).permute(0, 3, 1, 2)
        xs = x.view(b, c, Q, g, hg * p).permute(0, 1, 3, 2, 4)  # [b, c, g, Q, hg*p]
        Bs = B.view(b, c, Q, g, n).permute(0, 1, 3, 2, 4)  # [b, c, g, Q, n]
        Cs = C.view(b, c, Q, g, n).permute(0, 1, 3, 2, 4)
        # 2. C Bᵀ per chunk and group: [b, c, g, Q, Q]
        CB = torch.matmul(Cs, Bs.transpose(-1, -2))
        # 3. intra-chunk output: (C Bᵀ ∘ causal decay ∘ dt_s) x, per head: [b, c, h, Q, p]
        causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp((dA_cumsum[..., :, None] - dA_cumsum[..., None, :]).masked_fill(~causal, -math.inf))
        scores = decay * dt[..., None, :]  # [b, h, c, Q, Q]
        scores = scores.view(b, g, hg, c, Q, Q).permute(0, 3, 1, 2, 4, 5) * CB[:, :, :, None].float()
        xh = x.view(b, c, Q, h, p).permute(0, 1, 3, 2, 4)  # [b, c, h, Q, p]
        y_diag = torch.matmul(scores.to(dtype).reshape(b, c, h, Q, Q), xh)
        # 4. each chunk's state: Σ_s x_s (decay to the chunk's end · dt_s) B_sᵀ: [b, c, g, hg*p, n]
        to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum) * dt  # [b, h, c, Q]
        weight = to_end.view(b, g, hg, c, Q).permute(0, 3, 1, 4, 2)  # [b, c, g, Q, hg]
        xw = (xs.reshape(b, c, g, Q, hg, p) * weight[..., None]).to(dtype).reshape(b, c, g, Q, hg * p)
        states = torch.matmul(xw.transpose(-1, -2), Bs)
        # 5. states entering each chunk: the inter-chunk recurrence as a decay matrix (fp32)
        chunk_decay = F.pad(dA_cumsum[..., -1], (1, 0))  # [b, h, c+1]
        segsum = torch.cumsum(chunk_decay, dim=-1)
        inter = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()
        passing = torch.exp((segsum[..., :, None] - segsum[..., None, :]).masked_fill(~inter, -math.inf))
        states = F.pad(states.float().view(b, c, g, hg, p * n).permute(0, 2, 3, 1, 4), (0, 0, 1, 0))
        entering = torch.matmul(passing, states.reshape(b, h, c + 1, p * n))[:, :, :-1]  # [b, h, c, p*n]
        entering = entering.view(b, g, hg, c, p, n).permute(0, 3, 1, 5, 2, 4).reshape(b, c, g, n, hg * p)
        # 6. inter-chunk output: C · entering state, decayed to each position: [b, c, h, Q, p]
        y_off = torch.matmul(Cs, entering.to(dtype)).view(b, c, g, Q, hg, p).permute(0, 1, 2, 4, 3, 5)
        y_off = y_off.reshape(b, c, h, Q, p) * torch.exp(dA_cumsum).permute(0, 2, 1, 3)[..., None]
        y = (y_diag + y_off).permute(0, 1, 3, 2, 4).reshape(b, c * Q, h * p)
        skip = D.float().repeat_interleave(p) if D.numel() == h else D.float()
        y = (y + x * skip).to(dtype)
        return y[:, :seq] if pad else y


class GatedRMSNorm(torch.nn.Module):
    """Stand-in for ``mamba_ssm``'s gated ``RMSNorm`` (megatron-core's ``ExtendedRMSNorm``) with
    ``norm_before_gate=False``: ``rmsnorm(y * silu(z))`` over groups of ``group_size`` channels, times
    a weight. In megatron-core's training path the gate runs inside the fused scan kernel and the norm
    after it; the math and the tensors read are the same. Ops: ``silu``, ``mul``, then the RMS norm
    (``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``) and the weight ``mul``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5, dtype=None) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=_device()))
        setattr(self.weight, "tensor_model_parallel", True)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = y * F.silu(z)
        grouped = y.float().reshape(*y.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (grouped.reshape(y.shape) * self.weight.float()).to(dtype)


class MambaMixer(MegatronModule):
    """Stand-in for megatron-core's ``MambaMixer`` (``megatron.core.ssm.mamba_mixer``), same constructor.

    Replaces: the mixer of every Mamba layer of a hybrid stack (``M`` in ``hybrid_override_pattern``).
    Why: ``megatron.core.ssm.mamba_mixer`` imports triton at import, and ``MambaMixer`` needs the
    ``mamba_ssm`` (Triton kernels) and ``einops`` packages; triton and mamba_ssm need CUDA and do not
    install on a CPU machine.
    Parameters: those of ``MambaMixer``, same shapes and tensor-parallel split: ``in_proj`` (column
    parallel, hidden -> z, x, B, C, dt), ``conv1d`` (depthwise, over x, B, C, with bias), ``dt_bias``,
    ``A_log`` (fp32), ``D`` (fp32), ``norm.weight`` (gated RMSNorm), ``out_proj`` (row parallel).
    Ops (megatron-core's training path, ``mamba_split_conv1d_scan_combined`` then the norm): the
    ``in_proj`` GEMM; the split; the depthwise causal ``conv1d`` over ``[b, d_conv_local, l]`` and
    ``silu``; the chunked scan (:class:`ChunkedScan`, the ``ssd`` submodule); the gated RMS norm
    (:class:`GatedRMSNorm`); the ``out_proj`` GEMM. Context parallelism and inference caches are refused.
    """

    def __init__(self, config, submodules: MambaMixerSubmodules, d_model: int, d_conv: int = 4, conv_init=None,
                 expand: int = 2, A_init_range=(1, 16), D_has_hdim: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random",
                 dt_scale: float = 1.0, dt_init_floor: float = 1e-4, bias: bool = False, conv_bias: bool = True,
                 chunk_size: int = 128, layer_number: int | None = None, use_mem_eff_path=None, d_state=None,
                 headdim=None, ngroups=None, pg_collection=None, pp_layer_offset: int = 0,
                 name: str | None = None) -> None:
        super().__init__(config)
        if pg_collection is None:
            raise TraceError("the Mamba mixer needs its process groups (pg_collection), as megatron-core's does")
        if bias or norm_before_gate or not rmsnorm:
            raise TraceError(f"a Mamba mixer with bias={bias}, norm_before_gate={norm_before_gate}, "
                             f"rmsnorm={rmsnorm} is not traced by vtrain (megatron-core's training path: "
                             f"no bias, gated RMSNorm after the gate)")
        if pg_collection.cp.size() > 1:
            raise TraceError("context parallelism in a Mamba layer is not traced by vtrain yet")
        self.config = config
        self.d_model, self.d_conv, self.chunk_size = d_model, d_conv, chunk_size
        self.layer_number, self.pp_layer_offset, self.D_has_hdim = layer_number, pp_layer_offset, D_has_hdim
        self.d_state, self.headdim, self.ngroups = config.mamba_state_dim, config.mamba_head_dim, config.mamba_num_groups
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = int(expand * d_model)
            if self.d_inner % self.headdim:
                raise TraceError(f"Mamba d_inner ({self.d_inner}) must be a multiple of mamba_head_dim ({self.headdim})")
            self.nheads = self.d_inner // self.headdim
        tp = pg_collection.tp.size()
        for what, value in (("mamba heads", self.nheads), ("mamba_num_groups", self.ngroups)):
            if value % tp:
                raise TraceError(f"tensor_model_parallel_size ({tp}) must divide {what} ({value})")
        if self.nheads % self.ngroups:
            raise TraceError(f"mamba_num_groups ({self.ngroups}) must divide the mamba heads ({self.nheads})")
        self.nheads_local_tp, self.d_inner_local_tp, self.ngroups_local_tp = (
            self.nheads // tp, self.d_inner // tp, self.ngroups // tp)
        named = {"name": f"{name}.in_proj"} if name is not None else {}
        self.in_proj = build_module(
            submodules.in_proj, d_model, self.d_inner * 2 + 2 * self.ngroups * self.d_state + self.nheads,
            config=config, init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=pg_collection.tp, **named)
        conv_dim = self.d_inner_local_tp + 2 * self.ngroups_local_tp * self.d_state  # x B C
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim, padding=d_conv - 1,
                                      bias=conv_bias, device=_device(), dtype=config.params_dtype)
        local = self.nheads_local_tp
        self.dt_bias = torch.nn.Parameter(torch.empty(local, device=_device(), dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.empty(local, device=_device(), dtype=torch.float32))
        self.D = torch.nn.Parameter(torch.empty(self.d_inner_local_tp if D_has_hdim else local, device=_device(),
                                                dtype=torch.float32))
        self.ssd = ChunkedScan(chunk_size, self.headdim, self.ngroups_local_tp, self.d_state)
        self.norm = GatedRMSNorm(self.d_inner_local_tp, self.d_inner_local_tp // self.ngroups_local_tp,
                                 dtype=config.params_dtype)
        for p in (*self.conv1d.parameters(), self.dt_bias, self.A_log, self.D):
            setattr(p, "tensor_model_parallel", True)
        named = {"name": f"{name}.out_proj"} if name is not None else {}
        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, d_model, config=config, init_method=config.output_layer_init_method,
            bias=bias, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=pg_collection.tp, **named)
        self.tp_group = pg_collection.tp

    def forward(self, hidden_states: torch.Tensor, inference_context=None, *, inference_params=None,
                packed_seq_params=None):
        """``hidden_states``: [l (/tp with sequence parallelism), b, hidden]; returns (out, bias)."""
        if inference_context is not None or inference_params is not None or packed_seq_params is not None:
            raise TraceError("vtrain traces the Mamba mixer's training step only (no inference cache, no packed "
                             "sequences)")
        zxBCdt, _ = self.in_proj(hidden_states)  # [l, b, local widths]
        zxBCdt = zxBCdt.transpose(0, 1)  # [b, l, ...]
        x_width, bc_width = self.d_inner_local_tp, self.ngroups_local_tp * self.d_state
        z, xBC, dt = torch.split(zxBCdt, [x_width, x_width + 2 * bc_width, self.nheads_local_tp], dim=-1)
        seq = xBC.size(1)
        xBC = F.silu(self.conv1d(xBC.transpose(1, 2))[..., :seq]).transpose(1, 2).contiguous()  # [b, l, conv_dim]
        x, B, C = torch.split(xBC, [x_width, bc_width, bc_width], dim=-1)
        A = -torch.exp(self.A_log.float())
        y = self.ssd(x, dt, A, B, C, self.D, self.dt_bias)  # [b, l, d_inner_local]
        y = self.norm(y.transpose(0, 1).contiguous(), z.transpose(0, 1).contiguous())  # [l, b, d_inner_local]
        return self.out_proj(y)


class LocalNorm(SequenceParallelNorm):
    """Stand-in for TransformerEngine's ``TENorm`` where megatron-core hard-codes it: the final norm
    of ``MambaStack`` (0.16; ``HybridStack`` in 0.19), built whatever the stack's spec says.
    Why: TransformerEngine does not install on a CPU machine. Ops: torch's ``LayerNorm`` or
    ``RMSNorm`` per ``config.normalization``, as the local spec's norms (:class:`SequenceParallelNorm`)."""


def hybrid_stack_spec(*, num_experts: int | None = None, mamba_chunk_size: int | None = None) -> ModuleSpec:
    """A ``MambaStack`` spec from megatron-core's local modules, for ``MambaModel`` /
    ``hybrid_override_pattern``: megatron-core ships a TransformerEngine spec only
    (``models.mamba.mamba_layer_specs``, which also imports the triton-bound mixer).

    Layers, as the TE spec builds them, with the TE fusions undone: ``M`` a ``MambaLayer`` (its norm,
    fused into the TE ``in_proj``, as the layer's ``norm``; the :class:`MambaMixer` stand-in), ``*``
    a ``TransformerLayer`` with self-attention only (local linear layers, :class:`CoreAttention`),
    ``-`` an ``MLPLayer``, ``E`` a MoE layer (megatron-core's local MoE spec: SequentialMLP experts).
    Parameter counts equal the TE spec's. ``mamba_chunk_size``: the mixer's ``chunk_size``
    (megatron-core's default, 128, when None; no config field sets it).
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    moe_layer: Any = None
    if num_experts is not None:
        from megatron.core.transformer.transformer_layer import MoETransformerLayer

        moe = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=num_experts,
                                              moe_grouped_gemm=False)
        moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=SequenceParallelNorm, mlp=moe, mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=SequenceParallelNorm,
            mixer=ModuleSpec(module=MambaMixer, params=({"chunk_size": mamba_chunk_size} if mamba_chunk_size else {}),
                             submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(
                                          linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                          linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=SequenceParallelNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add)),
        **({"moe_layer": moe_layer} if moe_layer is not None else {}),
    ))


# --------------------------------------------------------------------------------------------------
# The scoped patches
# --------------------------------------------------------------------------------------------------


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Stand-in for megatron-core's ``moe_utils.sinkhorn`` (S-BASE routing, in the router's no-grad
    block): the same ops, iterated :data:`vtrain_plugin.specs.model.SINKHORN_ITERATIONS` times.

    Why: megatron-core iterates ``while error > tol``, reading a device value on the host each time;
    under fake tensors that value is unknown (and how many iterations a run takes is data). Ops: the
    exponential, then per iteration the two scaled row and column sums, their reciprocals, the mean
    absolute change and its comparison with ``tol``; the final scaling. The host read of each
    comparison is not recorded (no kernel)."""
    from vtrain_plugin.specs.model import SINKHORN_ITERATIONS

    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 0.00000001
    d1_old = d1
    for _ in range(SINKHORN_ITERATIONS):
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        _ = error > tol  # megatron-core's loop condition, on the device
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Stand-in for the all-reduce RowParallelLinear ends with: at one rank, the input itself (no
    kernel, no autograd node), else megatron-core's own.

    Why: megatron-core 0.16 returns the input as-is from its autograd function at one rank, and a
    biased SequentialMLP expert (TP = EP = 1) then adds its bias in place (``mlp.py``: ``output +=``),
    which autograd forbids on such an output. TransformerEngine's row-parallel linear, what the TE
    stack runs, returns a tensor of its own at TP 1 and trains; so the trace of the TE stack (built
    with the local linears: TE is absent on the CPU) must not fail there. No op is recorded either way."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    group = get_tensor_model_parallel_group_if_none(group)
    if group.size() == 1:
        return input_
    return mappings.reduce_from_tensor_model_parallel_region(input_, group=group)


class ExpertActivationRecompute(MLP):
    """A SequentialMLP expert whose activation is checkpointed (``recompute_modules`` "moe_act").

    megatron-core 0.16 recomputes the expert activation only in its grouped-GEMM experts (GroupedMLP,
    TEGroupedMLP), which need CUDA; vtrain traces SequentialMLP's experts and lowers them to grouped
    GEMMs (cost/lowering/megatron_core_te.py). This stand-in does to each traced expert what
    TEGroupedMLP does to its group: FC1, the activation under ``CheckpointWithoutOutput``, FC2, then
    the activation's output freed and recomputed when FC2's gradient arrives. Records the local
    spec's unfused activation ops once more, in the recompute phase. Set on a built expert by
    :func:`recompute_expert_activations`.
    """

    def forward(self, hidden_states, per_token_scale=None, bias=None, *, activation_only=False, **kwargs):
        from megatron.core.tensor_parallel import CheckpointWithoutOutput

        if activation_only:  # called through the module, so that the recorder sees the expert's ops
            return self._activation(hidden_states, bias, per_token_scale)
        fc1, bias = self.linear_fc1(hidden_states)
        checkpoint = CheckpointWithoutOutput()
        activated = checkpoint.checkpoint(functools.partial(self, activation_only=True), fc1, per_token_scale, bias)
        output, output_bias = self.linear_fc2(activated)
        checkpoint.discard_output_and_register_recompute(output)
        if per_token_scale is not None and output_bias is not None:
            output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)  # in place, as MLP.forward: its dtype
            output_bias = None
        return output, output_bias

    def _activation(self, x, bias, per_token_scale):
        """MLP.forward's unfused activation (megatron-core 0.16.1, bias_activation_fusion off as
        traced): bias, the gated unit with its clamp and linear offset or the plain activation,
        the routing probabilities."""
        if bias is not None:
            x = x + bias
        if self.config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(x, 2, dim=-1)
            if (clamp := self.config.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=clamp)
                x_linear = x_linear.clamp(min=-clamp, max=clamp)
            x = self.config.activation_func(x_glu) * (x_linear + self.config.glu_linear_offset)
        else:
            x = self.activation_func(x)
        if per_token_scale is not None:
            x = (x * per_token_scale.unsqueeze(-1)).to(x.dtype)
        return x


def recompute_expert_activations(module: torch.nn.Module) -> None:
    """Every SequentialMLP expert under ``module`` made an :class:`ExpertActivationRecompute` (this
    instance only). megatron-core's config accepts "moe_act" only with moe_grouped_gemm, which its
    local spec cannot build: the tracer asks for it here instead."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for experts in module.modules():
        if isinstance(experts, SequentialMLP):
            for expert in experts.local_experts:
                expert.__class__ = ExpertActivationRecompute


class NoFp8State:
    """TransformerEngine's ``FP8GlobalStateManager`` as megatron-core's ``CheckpointWithoutOutput``
    asks it (selective recompute of the norms, MLA's up projections, the expert activation): without
    TE no FP8 region is ever entered. vtrain prices FP8 in the lowering (cost/lowering/fp8.py)."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def no_fp8_region(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    """TE's ``activation_recompute_forward`` / ``fp8_autocast`` as ``CheckpointWithoutOutput`` enters
    them: outside FP8 they mark a region and change no op."""
    return contextlib.nullcontext()


def stand_in_patches() -> list[tuple[Any, str, Any]]:
    """``(object, attribute, stand-in)`` for each patch this module needs while tracing on the CPU;
    applied and restored by :func:`megatron_adapters.cpu_patches.cpu_tracing_patches`."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import utils
    from megatron.core.transformer.moe import router

    return [
        # RowParallelLinear's closing all-reduce at one rank (its doc): layers.py imported it by name
        (layers, "reduce_from_tensor_model_parallel_region", reduce_from_tensor_model_parallel_region),
        # TopKRouter.sinkhorn_load_balancing calls the sinkhorn router.py imported from moe_utils; its
        # loop runs until a device value converges, which fake tensors cannot decide
        (router, "sinkhorn", sinkhorn),
        # fused_softmax imported both names into its own namespace: patched there, where they are called
        (fused_softmax, "get_sliding_window_causal_mask", sliding_window_causal_mask),
        (fused_softmax, "get_default_causal_mask", default_causal_mask),
        (utils, "get_sliding_window_causal_mask", sliding_window_causal_mask),
        (utils, "get_default_causal_mask", default_causal_mask),
        *no_transformer_engine_patches(),
    ]


def no_transformer_engine_patches() -> list[tuple[Any, str, Any]]:
    """``(object, attribute, stand-in)`` for the names megatron-core 0.16 binds only when
    TransformerEngine imports and then uses anyway: needed wherever TE is absent, on the CPU while
    tracing and on a GPU training the local spec for real (``megatron_adapters.real_model``)."""
    import importlib

    from megatron.core.ssm.mamba_block import MambaStack
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # The module whose TENorm the stack's constructor reads: ssm.mamba_block in 0.16, while 0.19 defines
    # the stack in models.hybrid.hybrid_block and only re-exports it (and TENorm) from ssm.mamba_block.
    stack_module = importlib.import_module(MambaStack.__module__)

    return [
        # megatron-core 0.16 sets multi_latent_attention.HAVE_TE when its TE extension module imports,
        # which it does without TransformerEngine (TE is a MagicMock there): MLASelfAttention then
        # calls isinstance(linear_proj, TELinear) with the mock and fails. TE is absent: False.
        (multi_latent_attention, "HAVE_TE", False),
        # moe_utils binds TransformerEngine's GEMM only when TE imports, then tests it against None
        # in the router's gating GEMM: without TE the name must be None.
        (moe_utils, "te_general_gemm", None),
        (stack_module, "TENorm", LocalNorm),
        # random.py binds these three only when TransformerEngine imports; CheckpointWithoutOutput
        # (layernorm, mla_up_proj and moe_act recompute) calls them whatever the precision
        (megatron_random, "FP8GlobalStateManager", NoFp8State),
        (megatron_random, "activation_recompute_forward", no_fp8_region),
        (megatron_random, "fp8_autocast", no_fp8_region),
    ]
