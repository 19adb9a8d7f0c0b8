"""The optimizer step of a run whose optimizer is not fp32 Adam: a pass over a block's lowered (and,
with the distributed optimizer, sharded) optimizer kernels.

The stacks lower the traced step to multi-tensor passes, one of them Adam's (``*.multi_tensor_adam``,
28 bytes per parameter: :mod:`~vtrain_plugin.cost.lowering.megatron_core_te`). Here that pass becomes:

- Adam with state in other dtypes (precision-aware FusedAdam): the same pass moving
  :meth:`~vtrain_plugin.specs.optimizer.OptimizerSpec.adam_step_nbytes` per parameter;
- SGD with momentum: ``multi_tensor_sgd`` moving ``sgd_step_nbytes`` (20 in fp32) per parameter;
- Muon: Adam on the parameters that are not 2-D layer weights (norms, biases, embeddings, output
  layer: megatron-core's ``get_megatron_muon_optimizer``), and on each 2-D weight of ``r x c``
  (``m = min(r, c)``, ``n = max``): the momentum pass (``sgd_step_nbytes``), then ``k`` Newton-Schulz
  steps (``--muon-num-ns-steps``, 5 by default), each three GEMMs ``A = X Xᵀ`` (m x n x m),
  ``B = A A`` (m x m x m), ``X' = B X`` (m x m x n): ``4 m² n + 2 m³`` FLOPs per step, in bf16
  (``--muon-fp32-matmul-prec medium``, the default).
  A weight split by tensor parallelism is first all-gathered over its TP group in fp32 and every TP
  rank orthogonalises the whole matrix (``--muon-tp-mode duplicated``, the default): column-parallel
  weights (QKV, FC1) are cut along rows, row-parallel ones (``linear_proj``, ``linear_fc2``) along
  columns. Under the distributed optimizer each weight is stepped by one DP rank (the layer-wise
  distributed optimizer): a rank's share of the GEMMs is ``1 / shards`` of them, in FLOPs and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_adapters.conventions import OUTPUT_LAYER, is_embedding_module, is_expert_module
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, KernelKey, Node, OpNode, ParallelGroup, Phase
from vtrain_plugin.cost.lowering.fusion import op_name
from vtrain_plugin.specs.optimizer import OptimizerKind, OptimizerSpec

ADAM_PASS = "multi_tensor_adam"
FP32 = 4
BF16 = 2
ROW_PARALLEL = (".linear_proj", ".linear_fc2")  # cut along columns by tensor parallelism


def muon_matrices(nodes: Sequence[Node]) -> list[tuple[str, tuple[int, int]]]:
    """The (module, local shape) of every 2-D weight Muon steps in a traced block: each parameter's
    gradient norm in the traced step gives its shape; embeddings and the output layer excluded."""
    out = []
    for node in nodes:
        if (isinstance(node, OpNode) and node.phase is Phase.OPTIMIZER and op_name(node) == "linalg_vector_norm"
                and len(node.key.input_shapes[0]) == 2 and not is_embedding_module(node.module)
                and not node.module.startswith(OUTPUT_LAYER)):
            out.append((node.module, tuple(node.key.input_shapes[0])))
    return out


def newton_schulz_flops(rows: int, columns: int, steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on a ``rows x columns`` matrix (see the module doc)."""
    m, n = min(rows, columns), max(rows, columns)
    return steps * 2 * (2 * m * m * n + m ** 3)


def optimizer_step(nodes: Sequence[Node], spec: OptimizerSpec, *, traced: Sequence[Node], tensor_parallel: int,
                   expert_tensor_parallel: int, shards: int, expert_shards: int) -> tuple[Node, ...]:
    """``nodes`` (one block, lowered and sharded) with its Adam pass stepped as ``spec`` says; the
    block's ``traced`` nodes give Muon its matrices. Fp32 Adam returns ``nodes`` unchanged."""
    if spec == OptimizerSpec():
        return tuple(nodes)
    matrices = muon_matrices(traced) if spec.kind is OptimizerKind.MUON else []
    out: list[Node] = []
    for node in nodes:
        if not (isinstance(node, OpNode) and node.phase is Phase.OPTIMIZER and op_name(node) == ADAM_PASS):
            out.append(node)
            continue
        experts = is_expert_module(node.module)
        count = math.prod(node.key.input_shapes[0])
        mine = [(module, shape) for module, shape in matrices if is_expert_module(module) == experts]
        share = expert_shards if experts else shards
        matrix_numel = min(count, -(-sum(math.prod(s) for _, s in mine) // share))
        out.extend(_step(node, spec, count, matrix_numel, mine, share,
                         expert_tensor_parallel if experts else tensor_parallel, experts))
    return tuple(out)


def _pass(like: OpNode, op: str, numel: int, nbytes: int, spec: OptimizerSpec) -> OpNode:
    prefix = like.key.op.split(".")[0]
    args = (("optimizer", spec.kind.value), ("states", (spec.main_grads, spec.main_params, spec.exp_avg,
                                                         spec.exp_avg_sq)))
    return OpNode(key=KernelKey(op=f"{prefix}.{op}.default", input_shapes=((numel,),), dtypes=("float32",),
                                args=args),
                  phase=Phase.OPTIMIZER, module=like.module, output_shapes=((numel,),), nbytes=nbytes)


def _step(adam: OpNode, spec: OptimizerSpec, count: int, matrix_numel: int, matrices: list[tuple[str, tuple[int, int]]],
          share: int, tp: int, experts: bool) -> list[Node]:
    if spec.kind is OptimizerKind.ADAM:
        return [_pass(adam, ADAM_PASS, count, spec.adam_step_nbytes() * count, spec)]
    if spec.kind is OptimizerKind.SGD:
        return [_pass(adam, "multi_tensor_sgd", count, spec.sgd_step_nbytes() * count, spec)]
    out: list[Node] = []
    if count > matrix_numel:
        out.append(_pass(adam, ADAM_PASS, count - matrix_numel, spec.adam_step_nbytes() * (count - matrix_numel), spec))
    if matrix_numel:
        out.append(_pass(adam, "multi_tensor_sgd", matrix_numel, spec.sgd_step_nbytes() * matrix_numel, spec))
    group = ParallelGroup.EXPERT_TP if experts else ParallelGroup.TP
    for module, (rows, columns) in matrices:
        if tp > 1:
            rows, columns = (rows, columns * tp) if module.endswith(ROW_PARALLEL) else (rows * tp, columns)
            out.append(CollectiveNode(kind=CollectiveKind.ALL_GATHER, nbytes=FP32 * rows * columns // share,
                                      group=group, group_size=tp, phase=Phase.OPTIMIZER, module=module,
                                      dtype="float32", synthesized=True))
        out.extend(_newton_schulz(module, rows, columns, spec.muon_ns_steps, share))
    return out


def _newton_schulz(module: str, rows: int, columns: int, steps: int, share: int) -> list[OpNode]:
    """One weight's Newton-Schulz GEMMs on ``1 / share`` of the weights (see the module doc)."""
    m, n = min(rows, columns), max(rows, columns)
    shapes = (((m, n), (n, m)), ((m, m), (m, m)), ((m, m), (m, n)))
    out = []
    for _ in range(steps):
        for a, b in shapes:
            flops = 2 * a[0] * a[1] * b[1]
            nbytes = BF16 * (a[0] * a[1] + b[0] * b[1] + a[0] * b[1])
            out.append(OpNode(key=KernelKey(op="aten.mm.default", input_shapes=(a, b), dtypes=("bfloat16",) * 2,
                                            args=(("muon_share", share),) if share > 1 else ()),
                              phase=Phase.OPTIMIZER, module=module, output_shapes=((a[0], b[1]),),
                              flops=flops // share, nbytes=nbytes // share))
    return out
