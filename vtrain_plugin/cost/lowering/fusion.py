"""The pieces every software-stack lowering is made of: walking a block's nodes in groups, making
the node of a fused kernel, and the fusions Megatron-DeepSpeed and Megatron-Core share.

A block's nodes are walked in runs of consecutive kernel-launching ops of one *unit* (a module, or
a module and its children when a stack fuses them all, as fused attention does) and one phase;
collectives end a run and pass through; optimizer-phase ops are collected and mapped together
(their kernels are multi-tensor passes over the whole block), in the place of the first one; those
of a MoE layer's experts apart from the others (Megatron-Core keeps the experts' parameters in
buffers and optimizer groups of their own, sharded over expert DP when expert parallelism splits
them: :mod:`vtrain_plugin.cost.comm.optimizer_shard`). Ops
that launch no kernel are dropped. Each run is handed to the stack's rule, which returns the
kernels that stack launches for it.
"""

from __future__ import annotations

from typing import Any

import math
from collections.abc import Callable, Collection, Mapping, Sequence

from megatron_adapters.conventions import is_expert_module, is_mlp_module
from vtrain_plugin.core.dtypes import element_nbytes
from vtrain_plugin.core.graph import KernelKey, Node, OpNode, Phase
from vtrain_plugin.core.op_names import parse_op_name

FORWARD_PHASES = (Phase.FORWARD, Phase.RECOMPUTE)
MASK_NBYTES = 1  # a dropout mask kept as bytes by the fused kernels

Rule = Callable[[list[OpNode]], list[Node]]


def op_name(node: OpNode) -> str:
    """The op's name without namespace and overload (``bernoulli_``)."""
    return parse_op_name(node.op).name


def names(group: Sequence[OpNode]) -> tuple[str, ...]:
    return tuple(op_name(n) for n in group)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def dtype_nbytes(node: OpNode, index: int = 0) -> int:
    """Bytes per element of the node's ``index``-th tensor input."""
    return element_nbytes(node.key.dtypes[index])


def fused(op: str, like: OpNode, shape: Sequence[int], nbytes: int, dtype: str = "float16", *,
          flops: int = 0, input_shapes: Sequence[Sequence[int]] | None = None,
          args: tuple[tuple[str, Any], ...] = ()) -> OpNode:
    """A kernel of the stack standing for a group of traced ops starting with ``like`` (its phase
    and module); ``shape`` is its output, and its only input unless ``input_shapes`` says more;
    ``args`` are the kernel's arguments that change its work beyond its shapes (part of its key)."""
    inputs = (tuple(shape),) if input_shapes is None else tuple(tuple(s) for s in input_shapes)
    return OpNode(key=KernelKey(op=op, input_shapes=inputs, dtypes=(dtype,) * len(inputs), args=args),
                  phase=like.phase,
                  module=like.module, output_shapes=(tuple(shape),), flops=flops, nbytes=nbytes)


def splice(nodes: Sequence[Node], placed: Mapping[int, Sequence[Node]], dropped: Collection[int]) -> tuple[Node, ...]:
    """``nodes`` with ``placed[i]`` inserted before node ``i`` and the nodes at ``dropped`` left out:
    how a lowering swaps traced runs for the kernels that replace them."""
    out: list[Node] = []
    for i, node in enumerate(nodes):
        out.extend(placed.get(i, ()))
        if i not in dropped:
            out.append(node)
    return tuple(out)


def is_layer_root(module: str) -> bool:
    head, _, index = module.rpartition(".")
    return index.isdigit() and head.endswith("layers")


def lower_block(nodes: Sequence[Node], rule: Rule, optimizer: Callable[[list[OpNode]], list[OpNode]], *,
                unit: Callable[[str], str] = lambda module: module) -> tuple[Node, ...]:
    """The block's nodes with each run of one ``unit`` and phase replaced by ``rule(run)`` and its
    optimizer ops by ``optimizer(ops)`` (see the module doc)."""
    out: list[Node] = []
    group: list[OpNode] = []
    optimizer_ops: list[OpNode] = []
    optimizer_at = -1

    def flush() -> None:
        if group:
            out.extend(rule(list(group)))
            group.clear()

    for node in nodes:
        if isinstance(node, OpNode) and not node.launches_kernel:
            continue
        if isinstance(node, OpNode) and node.phase is Phase.OPTIMIZER:
            flush()
            if optimizer_at < 0:
                optimizer_at = len(out)
            optimizer_ops.append(node)
            continue
        if not isinstance(node, OpNode) or (
                group and (unit(node.module), node.phase) != (unit(group[0].module), group[0].phase)):
            flush()
        if isinstance(node, OpNode):
            group.append(node)
        else:
            out.append(node)
    flush()
    if optimizer_ops:
        experts = [n for n in optimizer_ops if is_expert_module(n.module)]
        others = [n for n in optimizer_ops if not is_expert_module(n.module)]
        out[optimizer_at:optimizer_at] = [*optimizer(others), *(optimizer(experts) if experts else ())]
    return tuple(out)


def replace_runs(group: list[OpNode], pattern: tuple[str, ...], make: Callable[[list[OpNode]], list[OpNode]]
                 ) -> list[OpNode]:
    """``group`` with every run of ops named ``pattern`` (in order, back to back) replaced by
    ``make(run)``; the other ops are kept."""
    out: list[OpNode] = []
    found = names(group)
    i = 0
    while i < len(group):
        if found[i:i + len(pattern)] == pattern:
            out.extend(make(group[i:i + len(pattern)]))
            i += len(pattern)
        else:
            out.append(group[i])
            i += 1
    return out


# ---------------------------------------------------------------------------------------------
# Fusions both Megatron stacks run (jit-fused functions of Megatron), bytes per element of the
# tensor involved in the model's 2-byte dtype: see the tables in lowering_mds and lowering_te.

_DROPOUT_OPS = ("bernoulli_", "div_", "mul")
_BIAS_DROPOUT_ADD_OPS = ("add", "bernoulli_", "div_", "mul", "add")
_BIAS_GELU_OPS = ("add", "gelu")


def dropout(group: list[OpNode], dtype: str = "float16") -> list[Node] | None:
    """``*dropout`` modules: bernoulli_, div_, mul -> ``native_dropout`` (x in, y and mask out);
    its backward mul -> ``native_dropout_backward``."""
    first = group[0]
    if not first.module.endswith("dropout"):
        return None
    found, shape = names(group), first.key.input_shapes[0]
    nbytes = (2 * element_nbytes(dtype) + MASK_NBYTES) * numel(shape)
    if first.phase in FORWARD_PHASES and found == _DROPOUT_OPS:
        return [fused("aten.native_dropout.default", first, shape, nbytes, dtype)]
    if first.phase is Phase.BACKWARD and found == ("mul",):
        return [fused("aten.native_dropout_backward.default", first, shape, nbytes, dtype)]
    return None


def bias_dropout_add(group: list[OpNode], dtype: str = "float16") -> list[Node] | None:
    """A layer's bias-dropout-add: add(bias), bernoulli_, div_, mul, add(residual) ->
    ``bias_dropout_add_fused_train`` (x, residual and bias in; out and mask out); its backward's
    dropout mul -> ``bias_dropout_add_fused_train_backward``, the bias gradient (``sum``) kept."""
    first = group[0]
    if not is_layer_root(first.module):
        return None
    found, shape, size = names(group), first.key.input_shapes[0], element_nbytes(dtype)
    if first.phase in FORWARD_PHASES and found == _BIAS_DROPOUT_ADD_OPS:
        bias = size * numel(first.key.input_shapes[1])
        return [fused("megatron.bias_dropout_add_fused_train.default", first, shape,
                      (3 * size + MASK_NBYTES) * numel(shape) + bias, dtype)]
    if first.phase is Phase.BACKWARD and found[:1] == ("mul",):
        return [fused("megatron.bias_dropout_add_fused_train_backward.default", first, shape,
                      (2 * size + MASK_NBYTES) * numel(shape), dtype), *group[1:]]
    return None


def unfused_bias_dropout_add(group: list[OpNode], dtype: str = "float16") -> list[Node] | None:
    """A layer's bias-dropout-add with ``bias_dropout_fusion`` off (megatron-core's
    ``bias_dropout_add_unfused``): the bias and residual adds as traced, the dropout between them as
    ``native_dropout`` (x in, y and mask out); its backward's dropout mul as ``native_dropout_backward``."""
    first = group[0]
    if not is_layer_root(first.module):
        return None
    found, size = names(group), element_nbytes(dtype)

    def native_dropout(run: list[OpNode]) -> list[OpNode]:
        shape = run[0].key.input_shapes[0]
        return [fused("aten.native_dropout.default", run[0], shape, (2 * size + MASK_NBYTES) * numel(shape), dtype)]

    if first.phase in FORWARD_PHASES and "bernoulli_" in found:
        return replace_runs(group, _DROPOUT_OPS, native_dropout)
    if first.phase is Phase.BACKWARD and found[:1] == ("mul",):
        shape = first.key.input_shapes[0]
        return [fused("aten.native_dropout_backward.default", first, shape, (2 * size + MASK_NBYTES) * numel(shape),
                      dtype), *group[1:]]
    return None


def jit_fusions(unfused: Collection[str] = ()) -> tuple[Callable[[list[OpNode], str], list[Node] | None], ...]:
    """The rules of Megatron's jit-fused dropout, bias-dropout-add and bias-GeLU, but those of the
    fusions ``unfused`` turns off (``training.unfused_kernels``): bias-dropout-add unfused, bias-GeLU
    left as traced."""
    return (dropout, unfused_bias_dropout_add if "bias_dropout" in unfused else bias_dropout_add,
            *(() if "bias_activation" in unfused else (bias_gelu,)))


def bias_gelu(group: list[OpNode], dtype: str = "float16") -> list[Node] | None:
    """The MLP's (or a MoE layer's local expert's) add(bias), gelu -> ``bias_gelu_fused`` (x and bias in, y out); gelu_backward ->
    ``bias_gelu_fused_backward`` (grad and input in, grad out), the bias gradient kept."""
    first = group[0]
    if not is_mlp_module(first.module):
        return None
    found, size = names(group), element_nbytes(dtype)
    if first.phase in FORWARD_PHASES and found == _BIAS_GELU_OPS:
        shape = first.key.input_shapes[0]
        bias = size * numel(first.key.input_shapes[1])
        return [fused("megatron.bias_gelu_fused.default", first, shape, 2 * size * numel(shape) + bias, dtype)]
    if first.phase is Phase.BACKWARD and found[:1] == ("gelu_backward",):
        shape = first.key.input_shapes[0]
        return [fused("megatron.bias_gelu_fused_backward.default", first, shape, 3 * size * numel(shape), dtype),
                *group[1:]]
    return None
