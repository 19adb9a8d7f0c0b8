"""The copy of the updated fp32 main weights into the model's weights, where megatron-core loops over
the parameters: one ``copy_`` kernel per parameter in place of the stack's one multi-tensor pass.

megatron-core 0.16 copies them parameter by parameter in two cases (optimizer/optimizer.py,
optimizer/distrib_optimizer.py): ``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params``
hands ``_multi_tensor_copy_this_to_that`` no overflow buffer for bf16 ("For bfloat, we don't have
multi-tensor apply"), which then runs ``that_.copy_(this_)`` for each parameter; and
``DistributedOptimizer._copy_main_params_to_model_params`` always runs
``shard_model_param.data.copy_(shard_main_param)`` for each parameter of the rank's shard. An fp16
model without the distributed optimizer copies in one ``multi_tensor_scale`` pass (kept as lowered);
Megatron-FSDP copies each parameter's shard too (``copy_main_weights_to_model_weights``, one
``copy_`` per parameter with elements on the rank: sharded as under the distributed optimizer); the
precision-aware optimizer (Adam writes the model weights itself) and torch FSDP2 (the optimizer
steps the sharded parameters themselves) copy none. On ``S`` shards a rank holds about ``1/S`` of a block's parameters, whole or cut at
the shard's edges: ``ceil(P / S)`` copies of its ``1/S`` of the elements, split evenly (dense
parameters over the dense shards, experts' over the expert shards). Why: each copy is a launch, and
the host cost per step of a block's parameters is what small layers pay, not their bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import Block, KernelKey, Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import op_name

COPY_PASS_OP = "multi_tensor_copy"
COPY_OP = "aten.copy_.default"
MAIN_NBYTES = 4  # the fp32 main weight read per element


def looped(dtype: Dtype, *, distributed_optimizer: bool, precision_aware: bool, torch_fsdp: bool) -> bool:
    """Whether megatron-core copies the main weights of a ``dtype`` model one parameter at a time
    (see the module doc; Megatron-FSDP counts as the distributed optimizer)."""
    if torch_fsdp or precision_aware or dtype not in (Dtype.BF16, Dtype.FP16):
        return False
    return dtype is Dtype.BF16 or distributed_optimizer


def _copies(like: OpNode, numels: Sequence[int], shards: int, dtype: Dtype) -> list[OpNode]:
    if not numels:
        return []
    if shards == 1:
        sizes = list(numels)
    else:
        count = -(-len(numels) // shards)
        sizes = [-(-sum(numels) // (shards * count))] * count
    return [OpNode(key=KernelKey(op=COPY_OP, input_shapes=((n,), (n,)), dtypes=(dtype.torch_name, "float32")),
                   phase=Phase.OPTIMIZER, module=like.module, output_shapes=((n,),),
                   nbytes=(dtype.nbytes + MAIN_NBYTES) * n) for n in sizes]


def weight_copies(nodes: Sequence[Node], block: Block, dtype: Dtype, shards: int = 1,
                  expert_shards: int = 1) -> tuple[Node, ...]:
    """``nodes`` (one block's optimizer step, lowered) with its multi-tensor weight copy replaced by
    one copy per parameter on this rank's shard (see the module doc)."""
    dense = block.parameter_numels or block.parameter_sizes
    experts = block.expert_parameter_numels
    out: list[Node] = []
    for node in nodes:
        if (isinstance(node, OpNode) and node.phase is Phase.OPTIMIZER and op_name(node) == COPY_PASS_OP
                and (dense or experts)):
            out.extend(_copies(node, dense, shards, dtype) + _copies(node, experts, expert_shards, dtype))
        else:
            out.append(node)
    return tuple(out)

