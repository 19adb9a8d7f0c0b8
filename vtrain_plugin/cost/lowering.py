"""Which kernels the measured software runs for the ops the tracer records.

The tracer records megatron-core's local layer spec on CPU: unfused attention (``baddbmm``, a
softmax in fp32 between two casts, dropout as ``bernoulli_``/``div_``/``mul``, ``bmm``), torch
LayerNorm, bias-add and GeLU as separate ops, residual dropout-add as five ops, and an Adam step of a
dozen unfused ops per parameter. A production stack runs fused kernels instead. A
:class:`SoftwareStack` names one such stack; its mapping rewrites a block's node sequence, replacing
each recognised group of consecutive ops of one module and phase by the kernels that stack launches,
with their own bytes. The mapped kernels are then timed like any other op, so the time of a group is
the time of its replacement, not the sum of its traced ops. Groups that match no rule are kept.

``local_spec`` is the identity (what megatron-core's local spec runs).

``megatron_deepspeed_2023`` is Megatron-DeepSpeed as of 2023 in fp16 (the software of the vTrain
A100 measurements); per element of the tensor involved (``n`` elements; fp16 is 2 bytes, a dropout
mask 1 byte):

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

import math
from collections.abc import Callable, Sequence

from vtrain_plugin.core.graph import KernelKey, Node, OpNode, Phase
from vtrain_plugin.core.op_names import parse_op_name
from vtrain_plugin.core.registry import Registry
from vtrain_plugin.specs.training import SoftwareStack


Mapping = Callable[[Sequence[Node]], tuple[Node, ...]]
_MAPPINGS: Registry[Mapping] = Registry("software stack", plural="stacks")


def register_stack(stack: SoftwareStack) -> Callable[[Mapping], Mapping]:
    return _MAPPINGS.register(stack)


def map_nodes(nodes: Sequence[Node], stack: SoftwareStack | str) -> tuple[Node, ...]:
    """The node sequence of one block as ``stack`` runs it."""
    return _MAPPINGS.get(stack)(nodes)


@register_stack(SoftwareStack.LOCAL_SPEC)
def _local_spec(nodes: Sequence[Node]) -> tuple[Node, ...]:
    return tuple(nodes)


# Bytes per element moved by the fused kernels (fp16 activations, 1-byte dropout masks).
_FP16 = 2
_MASK = 1
_SOFTMAX_FWD = 2 * _FP16
_SOFTMAX_BWD = 3 * _FP16
_DROPOUT = 2 * _FP16 + _MASK
_BIAS_DROPOUT_ADD = 3 * _FP16 + _MASK
_BIAS_GELU_FWD = 2 * _FP16
_BIAS_GELU_BWD = 3 * _FP16
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
_DROPOUT_OPS = ("bernoulli_", "div_", "mul")
_BIAS_DROPOUT_ADD_OPS = ("add", "bernoulli_", "div_", "mul", "add")
_BIAS_GELU_OPS = ("add", "gelu")
_LAYER_NORM = {"native_layer_norm": "apex.fused_layer_norm_affine.default",
               "native_layer_norm_backward": "apex.fused_layer_norm_affine_backward.default"}
_FORWARD_PHASES = (Phase.FORWARD, Phase.RECOMPUTE)


def _name(node: OpNode) -> str:
    return parse_op_name(node.op).name


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def fused(op: str, like: OpNode, shape: Sequence[int], nbytes: int, dtype: str = "float16") -> OpNode:
    """A kernel of the stack standing for a group of traced ops starting with ``like``."""
    return OpNode(key=KernelKey(op=op, input_shapes=(tuple(shape),), dtypes=(dtype,)), phase=like.phase,
                  module=like.module, output_shapes=(tuple(shape),), nbytes=nbytes)


def _is_layer_root(module: str) -> bool:
    head, _, index = module.rpartition(".")
    return index.isdigit() and head.endswith("layers")


def _map_group(group: list[OpNode]) -> list[OpNode]:
    """One run of kernels of one module and phase, as Megatron-DeepSpeed runs it."""
    names = tuple(_name(n) for n in group)
    first = group[0]
    module, phase = first.module, first.phase
    forward = phase in _FORWARD_PHASES
    if module.endswith("scale_mask_softmax"):
        shape = first.key.input_shapes[0]
        if forward and names == _SOFTMAX_FWD_OPS:
            return [fused("megatron.scaled_upper_triang_masked_softmax.default", first, shape,
                          _SOFTMAX_FWD * _numel(shape))]
        if phase is Phase.BACKWARD and names == _SOFTMAX_BWD_OPS:
            return [fused("megatron.scaled_upper_triang_masked_softmax_backward.default", first, shape,
                          _SOFTMAX_BWD * _numel(shape))]
    if module.endswith("dropout"):
        shape = first.key.input_shapes[0]
        if forward and names == _DROPOUT_OPS:
            return [fused("aten.native_dropout.default", first, shape, _DROPOUT * _numel(shape))]
        if phase is Phase.BACKWARD and names == ("mul",):
            return [fused("aten.native_dropout_backward.default", first, shape, _DROPOUT * _numel(shape))]
    if _is_layer_root(module):
        if forward and names == _BIAS_DROPOUT_ADD_OPS:
            shape = first.key.input_shapes[0]
            bias = _FP16 * _numel(first.key.input_shapes[1])
            return [fused("megatron.bias_dropout_add_fused_train.default", first, shape,
                          _BIAS_DROPOUT_ADD * _numel(shape) + bias)]
        if phase is Phase.BACKWARD and names[:1] == ("mul",):
            shape = first.key.input_shapes[0]
            return [fused("megatron.bias_dropout_add_fused_train_backward.default", first, shape,
                          _DROPOUT * _numel(shape)), *group[1:]]
    if module.endswith(".mlp"):
        if forward and names == _BIAS_GELU_OPS:
            shape = first.key.input_shapes[0]
            bias = _FP16 * _numel(first.key.input_shapes[1])
            return [fused("megatron.bias_gelu_fused.default", first, shape, _BIAS_GELU_FWD * _numel(shape) + bias)]
        if phase is Phase.BACKWARD and names[:1] == ("gelu_backward",):
            shape = first.key.input_shapes[0]
            return [fused("megatron.bias_gelu_fused_backward.default", first, shape,
                          _BIAS_GELU_BWD * _numel(shape)), *group[1:]]
    return [_layer_norm(n) if _name(n) in _LAYER_NORM else n for n in group]


def _layer_norm(node: OpNode) -> OpNode:
    return OpNode(key=KernelKey(op=_LAYER_NORM[_name(node)], input_shapes=node.key.input_shapes,
                                dtypes=node.key.dtypes, args=node.key.args),
                  phase=node.phase, module=node.module, output_shapes=node.output_shapes,
                  flops=node.flops, nbytes=node.nbytes)


def _map_optimizer(ops: list[OpNode]) -> list[OpNode]:
    """The block's optimizer step: per-parameter fp16->fp32 gradient copies, then apex's passes."""
    copies = [n for n in ops if _name(n) == "_to_copy" and n.key.dtypes[:1] == ("float16",)]
    if not copies:
        return ops
    numel = sum(_numel(n.key.input_shapes[0]) for n in copies)
    last = ops[-1]
    passes = [fused(f"apex.{name}.default", last, (numel,), per_param * numel, dtype="float32")
              for name, per_param in MULTI_TENSOR_PASSES]
    return [*copies, *passes]


@register_stack(SoftwareStack.MEGATRON_DEEPSPEED_2023)
def _megatron_deepspeed_2023(nodes: Sequence[Node]) -> tuple[Node, ...]:
    out: list[Node] = []
    group: list[OpNode] = []
    optimizer: list[OpNode] = []
    optimizer_at = -1

    def flush() -> None:
        if group:
            out.extend(_map_group(group))
            group.clear()

    for node in nodes:
        if isinstance(node, OpNode) and not node.launches_kernel:
            continue
        if isinstance(node, OpNode) and node.phase is Phase.OPTIMIZER:
            flush()
            if optimizer_at < 0:
                optimizer_at = len(out)
            optimizer.append(node)
            continue
        if not isinstance(node, OpNode) or (group and (node.module, node.phase) != (group[0].module, group[0].phase)):
            flush()
        if isinstance(node, OpNode):
            group.append(node)
        else:
            out.append(node)
    flush()
    if optimizer:
        out[optimizer_at:optimizer_at] = _map_optimizer(optimizer)
    return tuple(out)
