"""Megatron-Core with TransformerEngine (``megatron_core_te``): the kernels of today's Megatron runs.

Megatron-Core's TE layer spec builds each transformer layer from TransformerEngine modules
(``TELayerNormColumnParallelLinear``, ``TEDotProductAttention``, ``TERowParallelLinear``) and
Megatron's jit-fused functions (bias-dropout-add, bias-GeLU, SwiGLU, the vocabulary-parallel
cross-entropy); the optimizer is TE's multi-tensor FusedAdam. Per element of the tensor involved
(``n`` elements, ``e`` bytes each in the model dtype):

=========================================  ================================================  ===========
traced group (module, phase)               kernel of the stack                               bytes
=========================================  ================================================  ===========
core attention fwd (``core_attention`` and  ``te.fused_attention`` (FlashAttention-2/3 or      e(2Q + 2K)
its children: baddbmm, fp32 softmax, mask,  cuDNN): one kernel, no materialised scores;       + 4 b h s
dropout, bmm, context copy, GQA expansion,  FLOPs 4 b h s^2 d / 2 (the causal half; MLA:      (+ e h with
a window's mask, the sink column)           2 b h (s^2 / 2)(d_qk + d_v); a window: its        sinks)
                                            in-window scores instead of s^2 / 2)
core attention bwd (4 bmm, softmax and      ``te.fused_attention_backward``: one kernel,      e(4Q + 4K)
dropout backward, scaling, GQA reduction)   FLOPs 2.5 x forward (scores recomputed)           + 4 b h s
native_layer_norm (and backward)            ``te.layer_norm`` (as traced)                     as traced
RMSNorm fwd: 8 ops (cast, pow, mean, add,   ``te.rms_norm``: x, gamma in; y, rstd out          2e n + ...
rsqrt, mul, mul, cast)
RMSNorm bwd: 17 ops                         ``te.rms_norm_backward``: dy, x, gamma, rstd in;   3e n + ...
                                            dx, dgamma out
QK L2 norm (``q_layernorm``, ``k_layernorm``  ``megatron.l2_norm_fused`` (megatron-core's          2e n + 4r
with ``qk_l2_norm``) fwd: 7 ops, bwd: 13    ``jit_fuser``, ``torch.compile``: one kernel per   3e n + 4r
                                            tensor and direction; ``r`` rows)
``linear_*`` fwd bias add, bwd bias ``sum``  none: in the GEMM epilogue (cuBLASLt bias, bgrad)  0
rotary embedding (``self_attention``), per  ``te.fused_rope`` (and ``_backward``): t and the   2e n + 4 f
tensor: 12 ops fwd, 6 ops bwd (8 with       fp32 frequencies ``f`` in, out; the whole head,
``rotary_percent`` < 1)                     the channels it does not rotate copied through
``mlp`` / local expert silu, mul (SwiGLU)   ``megatron.swiglu_fused``: 2n in, n out           3e n
``mlp`` bwd mul, mul, silu_backward, cat    ``megatron.swiglu_fused_backward``                5e n
local expert quick GeGLU: mul, sigmoid,     ``megatron.quick_geglu_fused``: 2n in, n out       3e n
mul, add, mul (GPT-OSS)
local expert bwd: mul x4, sigmoid_backward,  ``megatron.quick_geglu_fused_backward``           5e n
mul, add
bias-GeLU, bias-dropout-add, dropout        as Megatron-DeepSpeed (:mod:`.fusion`)            as there
``loss`` fwd: cast + max                    ``megatron.vocab_parallel_ce_logits_max``         (e + 4) n
``loss`` fwd: mask, gather, exp, sum        ``megatron.vocab_parallel_ce_predicted_logits``   8 n
``loss`` fwd: 2 TP all-reduces              one all-reduce of both (Megatron batches them)    2x
``loss`` fwd: log, sub, div_                ``megatron.vocab_parallel_ce_loss``               8 n
``loss`` bwd: 7 ops up to mul_              ``megatron.vocab_parallel_ce_gradients``          8 n
optimizer phase, per parameter: ~14 ops     TE multi-tensor passes over the block (bytes per  46 (bf16)
                                            parameter): [unscale 8, fp16 only], L2 norm 4,    54 (fp16)
                                            clip scale 8, Adam 28, copy to the model          40 (fp32)
                                            weights 6 (not for fp32 models)
=========================================  ================================================  ===========

QK layer norms (``qk_layernorm``) are TE norms (``TENorm``) over each head, lowered as the layer's
norms. A squared-ReLU MLP stays as traced (relu, pow; four kernels backward): Megatron-LM runs it
unfused (``--disable-bias-linear`` turns its bias-activation fusion off, and the fused activations
are GeLU and SwiGLU only).

Quick GeGLU (``quick_gelu`` gated: ``x sigmoid(1.702 x) (y + offset)``) is megatron-core's
``weighted_bias_quick_geglu_impl`` in the experts, one jit-fused kernel each way over the fc1 output
as SwiGLU's; the clamp of its two halves (``activation_func_clamp_value``) stays as traced (two
clamps, and their masks backward) plus the ``cat`` that joins the clamped halves. A dense MLP runs it
unfused, as traced: megatron-core 0.16's MLP fuses quick GeGLU only with per-token weights.

``Q = b s h d`` and ``K = b s g d`` are the query and key elements (``h`` heads and ``g`` query
groups on this rank, ``b`` micro-batch, ``s`` sequence, ``d`` head dim). GEMMs, the residual adds,
the embedding, the QKV gradient concatenation and everything else stay as traced. The gradient
casts of the traced optimizer vanish: Megatron-Core accumulates gradients in an fp32 ``main_grad``
inside the weight-gradient GEMMs (gradient-accumulation fusion). FP8 is a pass over these kernels
(:mod:`vtrain_plugin.cost.lowering.fp8`).

Grouped-GEMM experts (``moe_grouped_gemm``: TE's ``TEGroupedMLP``) are a pass over the lowered
kernels of a MoE layer's ``SequentialMLP`` (:func:`group_expert_kernels`): the k-th kernel of every
local expert in a phase runs as one kernel over all their tokens (``te.grouped_gemm`` for a GEMM,
its FLOPs and bytes the sum of the experts'), and the concatenation of the experts' outputs (and its
backward) is gone: the grouped GEMM writes one tensor. The FP8 casts of the experts' GEMM inputs stay
one per expert where TE makes them so: ``GroupedLinear`` quantises its input and incoming gradient
with ``tex.split_quantize``, which fuses the splits into one multi-tensor cast-transpose only for
delayed scaling; with current scaling (``compute_amax`` then the cast) and the block-scaled recipes it
quantises each expert's split with its own kernels (:data:`SPLIT_QUANTISED`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import re
from dataclasses import replace

from megatron_adapters.conventions import is_expert_module, is_mlp_module
from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, KernelKey, Node, OpNode, ParallelGroup, Phase
from vtrain_plugin.cost.lowering import mamba
from vtrain_plugin.cost.lowering.fusion import (FORWARD_PHASES, MASK_NBYTES, dropout, dtype_nbytes, fused,
                                                is_layer_root, jit_fusions, lower_block, names, numel, op_name,
                                                replace_runs, splice)
from vtrain_plugin.cost.lowering.megatron_deepspeed import scaled_masked_softmax

FP32 = 4
ATTENTION_CAUSAL_FRACTION = 0.5  # of the score matrix a causal kernel computes
ATTENTION_BACKWARD_FLOPS = 2.5  # x forward: 5 matmuls of the score size against the forward's 2
LINEAR_MODULES = (".linear_qkv", ".linear_proj", ".linear_fc1", ".linear_fc2",
                  # multi-latent attention's projections (TE linears in megatron-core's MLA spec)
                  ".linear_q_proj", ".linear_q_down_proj", ".linear_q_up_proj", ".linear_kv_down_proj",
                  ".linear_kv_up_proj",
                  ".eh_proj")  # an MTP layer's projection of its embedding and hidden states
_ATTENTION_UNIT = ".core_attention"
WINDOW_MASK_OP = "aten.triu.default"  # the sliding-window mask's first op (stand_ins.sliding_window_causal_mask)

_RMSNORM_FWD_OPS = ("_to_copy", "pow", "mean", "add_", "rsqrt", "mul", "mul", "_to_copy")
_RMSNORM_BWD_OPS = ("_to_copy", "mul", "mul", "sum", "_to_copy", "mul", "mul", "sum", "pow", "mul", "mul", "div",
                    "pow", "mul", "mul", "add", "_to_copy")
_ROPE_FWD_OPS = ("cos", "mul", "_to_copy", "sin", "mul", "_to_copy", "mul", "neg", "cat", "mul", "add", "cat")
_ROPE_BWD_OPS = ("mul", "neg", "cat", "mul", "add", "add")
_PARTIAL_ROPE_BWD_OPS = ("mul", "neg", "cat", "mul", "add", "slice_backward", "slice_backward", "add")
_L2NORM_FWD_OPS = ("_to_copy", "pow", "mean", "add", "rsqrt", "mul", "_to_copy")
_L2NORM_BWD_OPS = ("_to_copy", "mul", "mul", "sum", "pow", "mul", "mul", "div", "pow", "mul", "mul", "add", "_to_copy")
_SWIGLU_FWD_OPS = ("silu", "add", "mul")
_SWIGLU_BWD_OPS = ("mul", "mul", "silu_backward", "cat")
_QUICK_GEGLU_FWD_OPS = ("mul", "sigmoid", "mul", "add", "mul")
_QUICK_GEGLU_BWD_OPS = ("mul", "mul", "mul", "mul", "sigmoid_backward", "mul", "add")
_CE_MAX_OPS = ("_to_copy", "max")
_CE_PREDICTED_OPS = ("sub_", "lt", "ge", "bitwise_or", "clone", "sub", "index_put_", "arange", "index", "clone",
                     "index_put_", "exp", "sum")
_CE_LOSS_OPS = ("log", "sub", "div_")
_CE_GRADIENT_OPS = ("arange", "_to_copy", "rsub", "index", "sub_", "index_put_", "mul_")
# TE's multi-tensor optimizer passes, bytes per parameter (fp32 main gradients, weights, moments).
UNSCALE_PASS = ("multi_tensor_unscale", 8)  # fp16 only: main grad read and written, inf/nan flag
OPTIMIZER_PASSES = (("multi_tensor_l2norm", 4), ("multi_tensor_scale", 8), ("multi_tensor_adam", 28))
COPY_PASS = ("multi_tensor_copy", 6)  # fp32 main weights to the 2-byte model weights


def attention_unit(module: str) -> str:
    """Core attention and its children (softmax, dropout) form one unit: one fused kernel."""
    head, found, _ = module.partition(_ATTENTION_UNIT)
    return head + found if found else module


def megatron_core_te(nodes: Sequence[Node], *, unfused_attention: bool = False,
                     unfused: Collection[str] = ()) -> tuple[Node, ...]:
    """The block's nodes as Megatron-Core with TransformerEngine runs them (see the module doc); a
    Mamba layer's mixer as mamba_ssm's kernels (:mod:`vtrain_plugin.cost.lowering.mamba`). With
    ``unfused_attention`` (TE's ``UnfusedDotProductAttention``, ``--attention-backend unfused``) the
    core attention runs as traced but for Megatron's fused scale-mask-softmax and dropout
    (:func:`unfused_attention_kernels`). The jit fusions ``unfused`` names (``training.unfused_kernels``)
    are off: bias-GeLU, SwiGLU and quick GeGLU (``bias_activation``) and RoPE (``rope``) as traced,
    bias-dropout-add unfused (``bias_dropout``); TE's attention ignores ``masked_softmax``."""
    windows = window_widths(nodes)
    mixers = mamba.mixer_dims(nodes)
    unfused = frozenset(unfused)
    if unfused_attention and not mixers:
        return _merge_loss_all_reduces(lower_block(nodes, lambda group: unfused_attention_kernels(group)
                                                   or _map_group(group, windows, unfused), map_optimizer))
    if not mixers:
        return _merge_loss_all_reduces(lower_block(nodes, lambda group: _map_group(group, windows, unfused),
                                                   map_optimizer, unit=attention_unit))

    def rule(group: list[OpNode]) -> list[Node]:
        unit = mamba.mixer_unit(group[0].module)
        if mamba.is_mixer_unit(unit):
            return mamba.lower_mixer(group, mixers.get(unit)) or group
        return _map_group(group, windows, unfused)

    return _merge_loss_all_reduces(lower_block(nodes, rule, map_optimizer,
                                               unit=lambda module: mamba.mixer_unit(attention_unit(module))))


def _map_group(group: list[OpNode], windows: Mapping[str, int] | None = None,
               unfused: frozenset[str] = frozenset()) -> list[Node]:
    first = group[0]
    dtype = first.key.dtypes[0] if first.key.dtypes else "float32"
    module, forward = first.module, first.phase in FORWARD_PHASES
    if module.endswith(_ATTENTION_UNIT):
        return _attention(group, windows) or group
    for rule in jit_fusions(unfused):
        mapped = rule(group, dtype)
        if mapped is not None:
            return mapped
    if module.endswith(("layernorm", "final_norm")) or is_layer_norm_slot(module):
        # RMSNorm first: the L2 norm's backward is the tail of RMSNorm's
        group = replace_runs(group, _RMSNORM_FWD_OPS if forward else _RMSNORM_BWD_OPS, _rms_norm)
        return _norm(replace_runs(group, _L2NORM_FWD_OPS if forward else _L2NORM_BWD_OPS, _l2_norm))
    if module.endswith(LINEAR_MODULES):
        dropped = "add" if forward else "sum"
        return [n for n in group if op_name(n) != dropped]
    if module.endswith(".self_attention"):
        if "rope" in unfused:
            return group
        if forward:
            return replace_runs(group, _ROPE_FWD_OPS, _rope)
        return replace_runs(replace_runs(group, _PARTIAL_ROPE_BWD_OPS, _rope), _ROPE_BWD_OPS, _rope)
    if is_mlp_module(module):
        if "bias_activation" in unfused:
            return group
        if is_expert_module(module):
            group = _quick_geglu(group, forward)
        return replace_runs(group, _SWIGLU_FWD_OPS if forward else _SWIGLU_BWD_OPS, _swiglu)
    if module.endswith("loss"):
        return _cross_entropy(group)
    return group


def unfused_attention_kernels(group: list[OpNode]) -> list[Node] | None:
    """A run of TE's unfused attention, one module at a time: the score and context GEMMs (and the
    context copy) as traced, the softmax as Megatron's fused ``scaled_upper_triang_masked_softmax``
    (TE's ``FusedScaleMaskSoftmax`` runs the same kernel), the dropout as ``native_dropout``; None
    for a run outside the core attention."""
    module = group[0].module
    if _ATTENTION_UNIT not in module:
        return None
    if module.endswith(_ATTENTION_UNIT):
        return list(group)
    dtype = group[0].key.dtypes[0] if group[0].key.dtypes else "float16"
    return scaled_masked_softmax(group) or dropout(group, dtype) or list(group)


def fused_softmax_saved_delta(nodes: Sequence[Node]) -> int:
    """What an unfused attention with a fused softmax (TE's unfused attention; Megatron's scaled
    masked softmax under ``megatron_deepspeed_2023``) keeps for backward minus what the trace kept
    (bytes per micro-batch; 0 when the attention is recomputed): the fused softmax keeps its output
    in the model dtype instead of the traced fp32 softmax. With attention dropout the context GEMM
    keeps the dropped-out probabilities besides (the dropout mask is
    :mod:`~vtrain_plugin.cost.lowering.dropout_masks`'); without, the tensor it keeps is the fused
    softmax's output itself, where the trace kept its model-dtype cast apart from the fp32 softmax
    (the fp32 copy goes entirely)."""
    attention = [n for n in nodes if isinstance(n, OpNode) and n.launches_kernel and _ATTENTION_UNIT in n.module]
    if any(n.phase is Phase.RECOMPUTE for n in attention):
        return 0
    forward = [n for n in attention if n.phase is Phase.FORWARD]
    by_name = {op_name(n): n for n in forward}
    if "_softmax" not in by_name or "bmm" not in by_name:
        return 0
    softmax = by_name["_softmax"]
    kept = dtype_nbytes(by_name["bmm"]) if "bernoulli_" in by_name else 0
    return numel(softmax.key.input_shapes[0]) * (kept - dtype_nbytes(softmax))


def unfused_backward_score_nbytes(nodes: Sequence[Node]) -> int:
    """The most score-sized bytes TE's unfused attention allocates in one core attention's backward
    (bytes per micro-batch, the largest attention of ``nodes``; 0 without one): the probabilities'
    gradient the context GEMM's backward writes in the model dtype (the fused softmax's backward
    then overwrites it in place with the scores' gradient), plus the probabilities again when the
    attention is recomputed. Its score GEMM's output is a fresh ``torch.empty`` freed after the
    softmax, so unlike megatron-core's local attention it holds no global score buffer."""
    rise = 0
    for unit in {n.module for n in nodes if isinstance(n, OpNode) and n.module.endswith(_ATTENTION_UNIT)}:
        ops = [n for n in nodes if isinstance(n, OpNode) and n.launches_kernel and n.module.startswith(unit)]
        softmax = next((n for n in ops if op_name(n) == "_softmax"), None)
        bmm = next((n for n in ops if op_name(n) == "bmm" and n.phase in FORWARD_PHASES), None)
        if softmax is None or bmm is None:
            continue
        copies = 2 if any(n.phase is Phase.RECOMPUTE for n in ops) else 1
        rise = max(rise, copies * numel(softmax.key.input_shapes[0]) * dtype_nbytes(bmm))
    return rise


def is_layer_norm_slot(module: str) -> bool:
    """A layer's ``norm`` (a Mamba layer's: TE fuses it into ``in_proj``, as the other layers' norms)."""
    head, _, leaf = module.rpartition(".")
    return leaf == "norm" and is_layer_root(head)


def _attention(group: list[OpNode], windows: Mapping[str, int] | None = None) -> list[Node] | None:
    """The core-attention unit of one phase as one fused kernel; None when it is not recognised.

    The score GEMM contracts over the query/key head dim ``dqk`` and the context GEMM over the value
    head dim ``dv`` (equal but for multi-latent attention); the kernel computes the scores it does
    not mask (:func:`scored_pairs`: half the score matrix under the causal mask, the in-window ones
    under a sliding window, whose width ``windows`` gives per unit); ``2 dqk + 2 dv`` FLOPs each
    (score and context), ``2.5`` times that backward. Attention sinks (a learnable softmax offset,
    one more softmax column per head) add the sinks' values read forward and their gradient written
    backward, and no GEMM work.
    """
    found = names(group)
    forward = group[0].phase in FORWARD_PHASES
    if forward and not (found.count("baddbmm") == 1 and found.count("bmm") == 1 and "_softmax" in found):
        return None
    if not forward and not (found.count("bmm") == 4 and "_softmax_backward_data" in found):
        return None
    softmax = next(n for n in group if op_name(n) in ("_softmax", "_softmax_backward_data"))
    b, heads, sq, columns = softmax.key.input_shapes[0]
    sinks = _has_sinks(group, forward)
    sk = columns - sinks
    gemms = [n for n in group if op_name(n) in ("baddbmm", "bmm")]
    gemm = gemms[0]
    if forward:
        dqk, dv = gemm.key.input_shapes[1][-1], gemms[1].key.input_shapes[1][-1]
    else:  # dV and dP contract over dv, dQ and dK over dqk: sq sk (2 dqk + 2 dv) multiply-adds per head
        dqk_dv = sum(_bmm_multiply_adds(n) for n in gemms) // (2 * b * heads * sq * sk)
        dv = gemms[0].key.input_shapes[1][-1]  # autograd runs the context GEMM's backward first: dV = Pᵀ dO
        dqk = dqk_dv - dv
    expanded = [n.key.input_shapes[0] for n in group if n.key.input_shapes and len(n.key.input_shapes[0]) == 5]  # GQA: (s, b, g, h/g, d)
    groups = expanded[0][2] if expanded else heads
    dtype = gemm.key.dtypes[0]
    e = element_nbytes(dtype)
    window = (windows or {}).get(attention_unit(group[0].module))
    pairs = scored_pairs(sq, sk, window)
    qo, kv, lse = b * sq * heads * (dqk + dv), b * sk * groups * (dqk + dv), FP32 * b * heads * sq
    sink_nbytes = e * heads * sinks
    flops = round(2 * b * heads * pairs * (dqk + dv))
    inputs = ((sq, b, heads, dqk), (sk, b, groups, dqk), (sk, b, groups, dv))
    # TE's arguments for the window and the sinks: kernels of the same shapes that do other work
    args = (*((("window_size", (window, 0)),) if window is not None else ()),
            *((("softmax_type", "learnable"),) if sinks else ()))
    if forward:
        return [fused("te.fused_attention.default", gemm, (sq, b, heads, dv), e * (qo + kv) + lse + sink_nbytes,
                      dtype, flops=flops, input_shapes=inputs, args=args)]
    return [fused("te.fused_attention_backward.default", gemm, (sq, b, heads, dqk),
                  e * 2 * (qo + kv) + lse + 2 * sink_nbytes, dtype, flops=round(ATTENTION_BACKWARD_FLOPS * flops),
                  input_shapes=inputs, args=args)]


def scored_pairs(sq: int, sk: int, window: int | None = None) -> float:
    """The (query, key) scores a causal fused-attention kernel computes: half the score matrix
    (``ATTENTION_CAUSAL_FRACTION``, as Megatron counts causal attention), or, under a sliding window
    of ``window`` keys back that is narrower than the keys, exactly the in-window pairs: query ``i``
    (the last ``sq`` of ``sk`` positions) attends to the keys ``i - window .. i``."""
    if window is None or window >= sk - 1:
        return sq * sk * ATTENTION_CAUSAL_FRACTION
    offset = sk - sq  # query i sits at key position i + offset
    full = min(window, offset) + 1  # key distances 0 .. offset: every query has that key
    tail = max(0, min(window, offset + sq - 1) - offset)  # distances offset + t: sq - t queries
    return full * sq + tail * sq - tail * (tail + 1) // 2


def window_widths(nodes: Sequence[Node]) -> dict[str, int]:
    """The sliding window (keys back) of each core-attention unit that has one, from the mask its
    forward builds (:func:`megatron_adapters.stand_ins.sliding_window_causal_mask`: ``triu`` of the
    ``[sq, sk]`` ones at diagonal ``sk - sq - window``)."""
    widths: dict[str, int] = {}
    for node in nodes:
        if isinstance(node, OpNode) and node.key.op == WINDOW_MASK_OP and _ATTENTION_UNIT in node.module:
            sq, sk = node.key.input_shapes[0]
            widths[attention_unit(node.module)] = sk - sq - dict(node.key.args)["diagonal"]
    return widths


def _has_sinks(group: list[OpNode], forward: bool) -> int:
    """1 when the unit's softmax has a sink column (``softmax_type="learnable"``): forward, the
    ``cat`` of the scores and one column; backward, the ``sum`` of that column's gradient."""
    name = "cat" if forward else "sum"
    return int(any(op_name(n) == name and n.key.input_shapes[-1][-1] == 1 and len(n.key.input_shapes[-1]) == 4
                   for n in group))


def _bmm_multiply_adds(node: OpNode) -> int:
    (batch, m, k), (_, _, n) = node.key.input_shapes[:2]
    return batch * m * k * n


def _norm(group: list[OpNode]) -> list[Node]:
    """torch LayerNorm kernels as TE's (same bytes)."""
    out: list[Node] = []
    for node in group:
        name = op_name(node)
        if name in ("native_layer_norm", "native_layer_norm_backward"):
            op = "te.layer_norm.default" if name == "native_layer_norm" else "te.layer_norm_backward.default"
            out.append(fused(op, node, node.key.input_shapes[0], node.nbytes, node.key.dtypes[0],
                             input_shapes=node.key.input_shapes))
        else:
            out.append(node)
    return out


def _rms_norm(run: list[OpNode]) -> list[OpNode]:
    first = run[0]
    shape = first.key.input_shapes[0]
    n, hidden = numel(shape), shape[-1]
    e = dtype_nbytes(first)
    rstd = FP32 * n // hidden
    if first.phase in FORWARD_PHASES:
        return [fused("te.rms_norm.default", first, shape, 2 * e * n + e * hidden + rstd, first.key.dtypes[0])]
    return [fused("te.rms_norm_backward.default", first, shape, 3 * e * n + 2 * e * hidden + rstd, first.key.dtypes[0])]


def _l2_norm(run: list[OpNode]) -> list[OpNode]:
    """megatron-core's compiled L2 norm of one tensor (queries or keys) as one kernel per direction."""
    first = run[0]
    shape = first.key.input_shapes[0]
    n, e = numel(shape), dtype_nbytes(first)
    rows = FP32 * n // shape[-1]
    if first.phase in FORWARD_PHASES:
        return [fused("megatron.l2_norm_fused.default", first, shape, 2 * e * n + rows, first.key.dtypes[0])]
    return [fused("megatron.l2_norm_fused_backward.default", first, shape, 3 * e * n + rows, first.key.dtypes[0])]


def _rope(run: list[OpNode]) -> list[OpNode]:
    """One fused RoPE kernel per rotated tensor (queries, keys) and phase, over the whole head (the
    last op's output) with the rotated channels' frequencies."""
    forward = run[0].phase in FORWARD_PHASES
    tensor = run[6] if forward else run[0]
    shape, freqs = run[-1].output_shapes[0], tensor.key.input_shapes[1]
    e = dtype_nbytes(tensor)
    op = "te.fused_rope.default" if forward else "te.fused_rope_backward.default"
    return [fused(op, tensor, shape, 2 * e * numel(shape) + FP32 * numel(freqs), tensor.key.dtypes[0],
                  input_shapes=(shape, freqs))]


def _swiglu(run: list[OpNode]) -> list[OpNode]:
    """Megatron's jit-fused SwiGLU over the fc1 output (2n elements) into n."""
    first = run[0]
    shape = first.key.input_shapes[0]
    n, e = numel(shape), dtype_nbytes(first)
    doubled = (*shape[:-1], 2 * shape[-1])
    if first.phase in FORWARD_PHASES:
        return [fused("megatron.swiglu_fused.default", first, shape, 3 * e * n, first.key.dtypes[0],
                      input_shapes=(doubled,))]
    return [fused("megatron.swiglu_fused_backward.default", first, doubled, 5 * e * n, first.key.dtypes[0],
                  input_shapes=(shape, doubled))]


def _quick_geglu(group: list[OpNode], forward: bool) -> list[OpNode]:
    """An expert's quick GeGLU as megatron-core's fused kernels (n output elements, e bytes each); a
    clamp first adds the ``cat`` of the clamped halves (2n in, 2n out)."""
    def forward_kernels(run: list[OpNode]) -> list[OpNode]:
        first = run[0]
        shape, e = first.key.input_shapes[0], dtype_nbytes(first)
        n, doubled = numel(shape), (*shape[:-1], 2 * shape[-1])
        clamped = [fused("aten.cat.default", first, doubled, 4 * e * n, first.key.dtypes[0],
                         input_shapes=(shape, shape))] if "clamp" in names(group) else []
        return [*clamped, fused("megatron.quick_geglu_fused.default", first, shape, 3 * e * n, first.key.dtypes[0],
                                input_shapes=(doubled,))]

    def backward_kernels(run: list[OpNode]) -> list[OpNode]:
        first = run[0]
        shape, e = first.key.input_shapes[0], dtype_nbytes(first)
        doubled = (*shape[:-1], 2 * shape[-1])
        return [fused("megatron.quick_geglu_fused_backward.default", first, doubled, 5 * e * numel(shape),
                      first.key.dtypes[0], input_shapes=(shape, doubled))]

    return replace_runs(group, _QUICK_GEGLU_FWD_OPS if forward else _QUICK_GEGLU_BWD_OPS,
                        forward_kernels if forward else backward_kernels)


def _cross_entropy(group: list[OpNode]) -> list[Node]:
    """Megatron-Core's fused vocabulary-parallel cross-entropy: the logits cast to fp32 once, the
    exponentials kept for backward as the softmax."""
    def kernel(name: str, at: int, nbytes_per_element: Callable[[OpNode], int]
               ) -> Callable[[list[OpNode]], list[OpNode]]:
        def make(run: list[OpNode]) -> list[OpNode]:
            logits = run[at]
            shape = logits.key.input_shapes[0]
            return [fused(f"megatron.vocab_parallel_ce_{name}.default", logits, shape,
                          nbytes_per_element(logits) * numel(shape), "float32")]
        return make

    group = replace_runs(group, _CE_MAX_OPS, kernel("logits_max", 0, lambda cast: dtype_nbytes(cast) + FP32))
    group = replace_runs(group, _CE_PREDICTED_OPS, kernel("predicted_logits", 0, lambda _: 2 * FP32))
    group = replace_runs(group, _CE_LOSS_OPS, kernel("loss", 2, lambda _: 2 * FP32))
    return replace_runs(group, _CE_GRADIENT_OPS, kernel("gradients", 6, lambda _: 2 * FP32))


def _merge_loss_all_reduces(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    """The cross-entropy's two TP all-reduces of one forward (predicted logits, sum of exps) as one
    all-reduce of both, as Megatron-Core's fused cross-entropy batches them."""
    out: list[Node] = []
    for node in nodes:
        prev = out[-1] if out else None
        if (isinstance(node, CollectiveNode) and isinstance(prev, CollectiveNode) and node == prev
                and node.kind is CollectiveKind.ALL_REDUCE and node.group is ParallelGroup.TP
                and node.phase is Phase.FORWARD and node.module.endswith("loss")):
            out[-1] = CollectiveNode(kind=node.kind, nbytes=2 * node.nbytes, group=node.group,
                                     group_size=node.group_size, phase=node.phase, module=node.module,
                                     dtype=node.dtype, synthesized=node.synthesized)
        else:
            out.append(node)
    return tuple(out)


def map_optimizer(ops: list[OpNode]) -> list[OpNode]:
    """The block's optimizer step as TE's multi-tensor passes over all its parameters (one gradient
    norm per parameter in the traced step gives their sizes)."""
    norms = [n for n in ops if op_name(n) == "linalg_vector_norm"]
    if not norms:
        return ops
    count = sum(numel(n.key.input_shapes[0]) for n in norms)
    casts = {n.key.dtypes[0] for n in ops if op_name(n) == "_to_copy"}
    passes = [*((UNSCALE_PASS,) if "float16" in casts else ()), *OPTIMIZER_PASSES, *((COPY_PASS,) if casts else ())]
    last = ops[-1]
    return [fused(f"te.{name}.default", last, (count,), per_param * count, "float32") for name, per_param in passes]


def fused_attention_saved_delta(nodes: Sequence[Node]) -> int:
    """What the fused attention of one layer keeps for backward minus what the traced unfused one
    keeps (bytes per micro-batch); 0 when the attention is recomputed (selective or full recompute
    keep none of its internals either way).

    The traced attention keeps the fp32 softmax output, the probabilities its context GEMM reads and
    the dropout mask (the score-sized tensors: ``b h s^2`` elements each, the mask at
    :data:`MASK_NBYTES` as a GPU keeps it, :mod:`~vtrain_plugin.cost.lowering.dropout_masks`; the causal mask, shared by
    every layer of a chunk, is a block of the stage of its own, which
    :func:`~vtrain_plugin.cost.stack_memory.stack_rank_memory` drops), and
    with grouped-query attention keys and values expanded to every query head; the fused kernel
    keeps none of these, but keys and values at their own size and the softmax statistics (one fp32
    value per query row). Queries, the output and, without GQA, keys and values are kept by both.
    """
    attention = [n for n in nodes if isinstance(n, OpNode) and n.launches_kernel and _ATTENTION_UNIT in n.module]
    if any(n.phase is Phase.RECOMPUTE for n in attention):
        return 0
    forward = [n for n in attention if n.phase is Phase.FORWARD]
    found = names(forward)
    if not (found.count("baddbmm") == 1 and found.count("bmm") == 1 and "_softmax" in found):
        return 0

    def kept(node: OpNode, index: int) -> int:
        return numel(node.key.input_shapes[index]) * dtype_nbytes(node, index)

    by_name = {op_name(n): n for n in forward}
    softmax, context = by_name["_softmax"], by_name["bmm"]
    b, heads, sq, _ = softmax.key.input_shapes[0]
    dropped = kept(softmax, 0) + kept(context, 0)
    if "bernoulli_" in by_name:
        dropped += numel(by_name["bernoulli_"].key.input_shapes[0]) * MASK_NBYTES
    expanded = [n for n in forward if n.key.input_shapes and len(n.key.input_shapes[0]) == 5]  # GQA: (s, b, g, h/g, d) clones
    added = FP32 * b * heads * sq
    for clone in expanded:
        s, batch, groups, _, d = clone.key.input_shapes[0]
        dropped += kept(clone, 0)
        added += s * batch * groups * d * dtype_nbytes(clone)
    return added - dropped


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)(?:\.|$)")
GROUPED_GEMM = "te.grouped_gemm.default"
# The FP8 casts TE's split_quantize runs once per expert (see the module doc): the block-scaled
# recipes' quantise kernels, and current scaling's amax and cast.
SPLIT_QUANTISED = frozenset({"quantize_fp8_block", "quantize_mxfp8"})
_CURRENT_SCALING = frozenset({"compute_amax", "cast_transpose"})


def group_expert_kernels(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """``nodes`` (one block, lowered) with each MoE layer's per-expert kernels as grouped ones (see
    the module doc): per phase, the experts' kernel sequences zipped position by position, each
    position one kernel placed where the first expert kernel of the phase was. A phase whose experts
    run different kernel sequences is left as traced."""
    by_phase: dict[tuple[Phase, str], dict[int, list[int]]] = {}
    for i, node in enumerate(nodes):
        found = _LOCAL_EXPERT.search(node.module) if isinstance(node, OpNode) else None
        if found and node.phase is not Phase.OPTIMIZER:
            layer = node.module[:found.start()]
            by_phase.setdefault((node.phase, layer), {}).setdefault(int(found.group(1)), []).append(i)
    if not by_phase:
        return tuple(nodes)
    placed: dict[int, list[Node]] = {}
    dropped: set[int] = set()
    for (phase, layer), experts in by_phase.items():
        sequences = [[nodes[i] for i in experts[e]] for e in sorted(experts)]
        if len(sequences) < 2 or len({tuple(op_name(n) for n in seq) for seq in sequences}) != 1:
            continue
        per_expert = SPLIT_QUANTISED | (_CURRENT_SCALING if "compute_amax" in map(op_name, sequences[0]) else set())
        placed[min(min(ix) for ix in experts.values())] = [
            node for column in zip(*sequences)
            for node in (_renamed(column) if op_name(column[0]) in per_expert else (_grouped(list(column)),))]
        dropped.update(i for ix in experts.values() for i in ix)
        concat = f"{layer}.mlp.experts"  # SequentialMLP's cat of the experts' outputs (and its backward)
        dropped.update(i for i, n in enumerate(nodes) if isinstance(n, OpNode) and n.phase is phase
                       and n.module == concat and op_name(n) == "cat")
    return splice(nodes, placed, dropped)


def _grouped_module(module: str) -> str:
    return _LOCAL_EXPERT.sub(lambda m: ".mlp.experts" + (m.group(0)[-1] if m.group(0).endswith(".") else ""), module)


def _renamed(column: Sequence[OpNode]) -> tuple[OpNode, ...]:
    """The same kernel of every local expert, one each, as the grouped module runs them."""
    return tuple(replace(n, module=_grouped_module(n.module)) for n in column)


def _grouped(column: list[OpNode]) -> OpNode:
    """One kernel for the same kernel of every local expert: FLOPs and bytes summed, each input the
    experts' inputs side by side (a GEMM's as a batch of experts, its rows their mean when they differ)."""
    first = column[0]
    module = _grouped_module(first.module)
    nbytes = sum(n.nbytes for n in column)
    shapes = [n.key.input_shapes for n in column]
    if op_name(first) in ("mm", "_scaled_mm"):  # FP8 GEMMs too (lowering.fp8 runs before this pass)
        flops = sum(n.flops or 2 * n.key.input_shapes[0][0] * n.key.input_shapes[0][1] * n.key.input_shapes[1][1]
                    for n in column)
        inputs = [(len(column), *(-(-sum(s[k][d] for s in shapes) // len(column)) for d in range(len(first.key.input_shapes[k]))))
                  for k in range(len(first.key.input_shapes))]
        out = (sum(n.output_shapes[0][0] for n in column), *first.output_shapes[0][1:])
        return OpNode(key=KernelKey(op=GROUPED_GEMM, input_shapes=tuple(inputs), dtypes=first.key.dtypes),
                      phase=first.phase, module=module, output_shapes=(out,), flops=flops, nbytes=nbytes)
    inputs = [(sum(s[k][0] for s in shapes), *first.key.input_shapes[k][1:]) if first.key.input_shapes[k] else ()
              for k in range(len(first.key.input_shapes))]
    outputs = tuple((sum(n.output_shapes[j][0] for n in column), *o[1:]) if o else ()
                    for j, o in enumerate(first.output_shapes))
    return OpNode(key=KernelKey(op=first.op, input_shapes=tuple(inputs), dtypes=first.key.dtypes), phase=first.phase,
                  module=module, output_shapes=outputs, flops=sum(n.flops for n in column), nbytes=nbytes)
