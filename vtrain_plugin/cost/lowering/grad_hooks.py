"""Megatron-Core's per-parameter gradient hook (DDP's and Megatron-FSDP's): one ``main_grad.add_(grad)``
(or ``copy_``) kernel per parameter and micro-batch in the backward, unless the weight-gradient GEMM
accumulated into ``main_grad`` itself.

megatron-core's ``DistributedDataParallel`` registers a backward hook on every parameter
(``_make_backward_post_hook``, distributed/distributed_data_parallel.py): when the parameter's
gradient is ready, unless ``param.grad_added_to_main_grad``, it runs ``param.main_grad.add_(param.grad)``
into the fp32 (or bf16) gradient buffer, then drops ``param.grad``. A linear layer's weight with
gradient-accumulation fusion (Megatron-LM's default; off with ``--no-gradient-accumulation-fusion``)
has its weight-gradient GEMM write into ``main_grad`` and sets that flag, so it needs no add; every
other parameter (biases, norms, the word embedding, and every weight without the fusion) gets one.
Megatron-FSDP's post-backward hook (``_process_post_backward_gradients``, fsdp/src/megatron_fsdp/
megatron_fsdp.py) does the same per parameter: ``main_grad.copy_(grad)`` into the bucket it then
reduce-scatters where the gradients are sharded (``optim_grads``, ``optim_grads_params``), the add
otherwise; torch FSDP2 gathers its gradients with one batched copy and has no such hook.
The trace runs the model without DDP, so these kernels are added here, per block instance, at the end
of its backward: one element-wise kernel each, reading the gradient (model dtype) and reading and
writing ``main_grad``; the host issues each as a kernel (the stack's ``host_overhead_ns``), its Python
hook included. A parameter counts as a linear weight when its element count is that of a weight
gradient its block's traced backward computes (the output of a backward ``mm``).

Why: with small layers these launches are a fixed host cost per parameter, which MoE layers (every
expert's weights are parameters, grouped GEMMs or not) pay far more of than their kernels suggest.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import Block, KernelKey, Node, OpNode, Phase

ADD_OP = "aten.add_.Tensor"
COPY_OP = "aten.copy_.default"
_WGRAD_OPS = ("aten.mm.default",)


@dataclass(frozen=True, slots=True)
class GradHooks:
    """What the hook does on a run: whether weight-gradient GEMMs accumulate into ``main_grad``
    (gradient-accumulation fusion), the dtype of a gradient (the model's) and of ``main_grad``, and
    whether it adds into ``main_grad`` or copies into it (Megatron-FSDP with sharded gradients)."""

    fused_weights: bool
    grad: Dtype
    main_grad: Dtype
    copies: bool = False


def fused_weight_numels(block: Block) -> Counter[int]:
    """Element counts of the weight gradients the block's traced backward computes (its ``mm`` outputs)."""
    return Counter(math.prod(node.output_shapes[0]) for node in block.nodes
                   if isinstance(node, OpNode) and node.phase is Phase.BACKWARD and node.op in _WGRAD_OPS
                   and node.output_shapes)


def hooked_numels(block: Block, hooks: GradHooks) -> tuple[int, ...]:
    """Elements of each parameter of one instance of ``block`` whose hook runs an add (see the module doc)."""
    params = (*block.parameter_numels, *block.expert_parameter_numels) or block.parameter_sizes
    if not hooks.fused_weights:
        return tuple(params)
    weights = fused_weight_numels(block)
    out = []
    for numel in params:
        if weights[numel]:
            weights[numel] -= 1
        else:
            out.append(numel)
    return tuple(out)


def grad_hook_adds(nodes: Sequence[Node], block: Block, hooks: GradHooks | None) -> tuple[Node, ...]:
    """``nodes`` (one block, lowered) with one ``main_grad`` add per hooked parameter after its
    backward, in the module of the backward's last kernel (no module call of its own)."""
    if hooks is None:
        return tuple(nodes)
    last = max((i for i, n in enumerate(nodes) if isinstance(n, OpNode) and n.phase is Phase.BACKWARD
                and n.launches_kernel), default=-1)
    numels = hooked_numels(block, hooks)
    if last < 0 or not numels:
        return tuple(nodes)
    module = nodes[last].module
    per_element = hooks.grad.nbytes + (1 if hooks.copies else 2) * hooks.main_grad.nbytes
    dtypes = (hooks.main_grad.torch_name, hooks.grad.torch_name)
    op = COPY_OP if hooks.copies else ADD_OP
    adds = [OpNode(key=KernelKey(op=op, input_shapes=((n,), (n,)), dtypes=dtypes), phase=Phase.BACKWARD,
                   module=module, output_shapes=((n,),), flops=n, nbytes=per_element * n) for n in numels]
    return (*nodes[:last + 1], *adds, *nodes[last + 1:])
