"""Megatron-DeepSpeed as of 2023 in fp16: the software of the vTrain A100 measurements.

Per element of the tensor involved (``n`` elements; fp16 is 2 bytes, a dropout mask 1 byte):

=======================================  ====================================================  ==========
traced group (module, phase)             kernel of the stack                                   bytes / n
=======================================  ====================================================  ==========
``scale_mask_softmax`` fwd: _to_copy,    ``scaled_upper_triang_masked_softmax`` (fused causal   4
masked_fill_, _softmax, _to_copy         scale-mask-softmax, fp16 in and out)
``scale_mask_softmax`` bwd: _to_copy,    ``scaled_upper_triang_masked_softmax_backward``        6
_softmax_backward_data, masked_fill,     (reads output grad and probabilities, writes grad)
_to_copy
``*dropout`` fwd: bernoulli_, div_, mul  ``native_dropout`` (x in, y and mask out)              5
``*dropout`` bwd: mul                    ``native_dropout_backward``                            5
layer fwd: add(bias), bernoulli_, div_,  ``bias_dropout_add_fused_train`` (x, residual in;      7
mul, add(residual)                       out, mask out)
layer bwd: mul (dropout grad)            ``bias_dropout_add_fused_train_backward``              5
``mlp`` fwd: add(bias), gelu             ``bias_gelu_fused``                                    4
``mlp`` bwd: gelu_backward               ``bias_gelu_fused_backward`` (grad, input in, grad     6
                                         out)
native_layer_norm (and backward)         apex ``fused_layer_norm_affine`` (same bytes)          as traced
optimizer phase, per parameter: 14 ops   ``_to_copy`` of the fp16 gradient into the fp32 main   6
                                         gradient (kept, one per parameter), then for all of
                                         the block's parameters five apex multi-tensor
                                         kernels: unscale and inf check (8), gradient norm
                                         (4), clipping scale (8), Adam on fp32 main weights
                                         and moments (28: g, p, m, v read, p, m, v written),
                                         copy to the fp16 model weights (6)                    60 total
=======================================  ====================================================  ==========

Bias gradients (``sum``), attention batched GEMMs, the context copy and everything else stay as
traced. The multi-tensor kernels are launched once per block (apex launches one per ~2M-element
chunk list, about as many for a transformer layer). A model without the fp16 gradient copy in its
optimizer step (bf16/fp32 ``main_grad`` flows) keeps its traced optimizer ops.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vtrain_plugin.core.graph import KernelKey, Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import FORWARD_PHASES, fused, jit_fusions, lower_block, names, numel, op_name

_FP16 = 2
_SOFTMAX_FWD = 2 * _FP16
_SOFTMAX_BWD = 3 * _FP16
# apex multi-tensor passes of Megatron's fp16 optimizer, bytes per parameter each.
MULTI_TENSOR_PASSES: tuple[tuple[str, int], ...] = (
    ("multi_tensor_unscale", 8),  # fp32 main grad read and written, inf/nan flag
    ("multi_tensor_l2norm", 4),  # gradient norm for clipping
    ("multi_tensor_scale", 8),  # clip: main grad scaled in place
    ("multi_tensor_adam", 28),  # read g, p, m, v; write p, m, v (fp32)
    ("multi_tensor_copy", 6),  # fp32 main weights to fp16 model weights
)

_SOFTMAX_FWD_OPS = ("_to_copy", "masked_fill_", "_softmax", "_to_copy")
_SOFTMAX_BWD_OPS = ("_to_copy", "_softmax_backward_data", "masked_fill", "_to_copy")
_LAYER_NORM = {"native_layer_norm": "apex.fused_layer_norm_affine.default",
               "native_layer_norm_backward": "apex.fused_layer_norm_affine_backward.default"}


def scaled_masked_softmax(group: list[OpNode]) -> list[Node] | None:
    """Megatron's fused causal scale-mask-softmax (and its backward) for a ``scale_mask_softmax`` run."""
    first = group[0]
    if not first.module.endswith("scale_mask_softmax"):
        return None
    found, shape = names(group), first.key.input_shapes[0]
    if first.phase in FORWARD_PHASES and found == _SOFTMAX_FWD_OPS:
        return [fused("megatron.scaled_upper_triang_masked_softmax.default", first, shape, _SOFTMAX_FWD * numel(shape))]
    if first.phase is Phase.BACKWARD and found == _SOFTMAX_BWD_OPS:
        return [fused("megatron.scaled_upper_triang_masked_softmax_backward.default", first, shape,
                      _SOFTMAX_BWD * numel(shape))]
    return None


def map_group(group: list[OpNode], unfused: Collection[str] = ()) -> list[Node]:
    """One run of kernels of one module and phase, as Megatron-DeepSpeed runs it; the fusions
    ``unfused`` names (``training.unfused_kernels``) off: their ops as traced, the masked softmax's
    included (:func:`~vtrain_plugin.cost.lowering.fusion.jit_fusions`)."""
    softmax = () if "masked_softmax" in unfused else (lambda g, _: scaled_masked_softmax(g),)
    for rule in (*softmax, *jit_fusions(unfused)):
        mapped = rule(group, "float16")
        if mapped is not None:
            return mapped
    return [_layer_norm(n) if op_name(n) in _LAYER_NORM else n for n in group]


def _layer_norm(node: OpNode) -> OpNode:
    return OpNode(key=KernelKey(op=_LAYER_NORM[op_name(node)], input_shapes=node.key.input_shapes,
                                dtypes=node.key.dtypes, args=node.key.args),
                  phase=node.phase, module=node.module, output_shapes=node.output_shapes,
                  flops=node.flops, nbytes=node.nbytes)


def _map_optimizer(ops: list[OpNode]) -> list[OpNode]:
    """The block's optimizer step: per-parameter fp16->fp32 gradient copies, then apex's passes."""
    copies = [n for n in ops if op_name(n) == "_to_copy" and n.key.dtypes[:1] == ("float16",)]
    if not copies:
        return ops
    count = sum(numel(n.key.input_shapes[0]) for n in copies)
    last = ops[-1]
    passes = [fused(f"apex.{name}.default", last, (count,), per_param * count, dtype="float32")
              for name, per_param in MULTI_TENSOR_PASSES]
    return [*copies, *passes]


def megatron_deepspeed_2023(nodes: Sequence[Node], *, unfused: Collection[str] = ()) -> tuple[Node, ...]:
    """The block's nodes as Megatron-DeepSpeed (2023, fp16) runs them (see the module doc), with the
    fusions ``unfused`` names off."""
    return lower_block(nodes, lambda group: map_group(group, unfused), _map_optimizer)
