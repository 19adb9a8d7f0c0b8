"""Communication Megatron's runtime adds around the model: derived from the traced graph, not traced.

The model's own collectives (tensor-parallel all-reduce, all-gather, reduce-scatter) are captured
while tracing. Three more run outside the model in Megatron and are derived here from what the trace
recorded, once per stage:

- the data-parallel gradient reduction: each block's gradients (its parameters in the run's
  gradient dtype, :meth:`vtrain_plugin.specs.training.TrainingSpec.grad_dtype`: bf16 with
  ``grad_reduce_in_bf16``) all-reduced over the DP group,
  DP x CP ranks (:attr:`ParallelPlan.grad_reduce_group_size`), when there are more than one; those
  of experts split by expert parallelism over the expert DP group instead (TP x CP x DP / (EP x
  expert TP) ranks, :attr:`ParallelPlan.expert_data_parallel`), when there are more than one; with
  the distributed optimizer reduce-scattered instead, and the parameters (model dtype; with
  ``fp8_param_gather`` the weights of the layers' linears in FP8, one byte each, as
  TransformerEngine keeps them) all-gathered after the optimizer step (the buckets, with
  Megatron-Core's padding, are laid out by :mod:`vtrain_plugin.cost.comm.param_buffer` when the stage
  is costed); with the distributed optimizer in ``N`` instances
  (``ParallelPlan.distributed_optimizer_instances``) reduce-scattered over the ``size / N`` ranks of
  the rank's instance, the reduced shard (``1 / (size / N)`` of the bytes) all-reduced over the ``N``
  instances, and the parameters all-gathered inside the instance (megatron-core's
  ``_ParamAndGradBucketGroup.start_grad_sync`` and ``start_param_sync``);
- the pipeline point-to-point traffic of one micro-batch: the stage-boundary activation sent to the
  next virtual stage in forward and its gradient sent back in backward (and the matching receives);
- the tied-embedding synchronisation: with tied embeddings and ``pipeline_parallel > 1`` the first
  stage's word embedding and the last stage's output weight are one tensor, whose gradient is
  all-reduced (gradient dtype) over the two-rank embedding group.

All are :class:`CollectiveNode` s marked ``synthesized``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vtrain_plugin.core.dtypes import Dtype, element_nbytes
from vtrain_plugin.core.graph import Block, BlockKind, CollectiveKind, CollectiveNode, ParallelGroup, Phase, StageGraph
from megatron_adapters.conventions import OUTPUT_LAYER, WORD_EMBEDDING
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import grad_dtype

# Norm weights and biases of a layer hold at most 4 x hidden elements (the GeLU MLP's first bias);
# its linears' weights at least hidden x hidden / TP, more for any TP below hidden / 4. The larger
# parameters of a layer are thus the weights TransformerEngine keeps in FP8 with fp8_param_gather
# (with them the MoE router's gate, experts x hidden elements, a rounding error).
_FP8_WEIGHT_MIN_HIDDENS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeCollectives:
    """What Megatron's runtime communicates for one stage (see the module doc)."""

    dp_grad_nbytes: tuple[int, ...]  # per block instance, in the stage's block order (0 without DP)
    dp_group_size: int
    expert_dp_grad_nbytes: tuple[int, ...]  # per block instance: its expert-parallel parameters' gradients
    expert_dp_group_size: int
    grad_dtype: Dtype
    param_dtype: Dtype
    distributed_optimizer: bool
    embedding_sync: tuple[CollectiveNode, ...]  # at most one
    p2p: tuple[CollectiveNode, ...]  # per micro-batch: recv/send forward, recv/send backward
    # Forward index (over the stage's parameters) of the tied word embedding / output weight, which
    # the distributed optimizer gives a bucket of its own; None when it is not shared over a pipeline.
    shared_embedding_param: int | None = None
    # Elements above which a layer's parameter is a linear weight all-gathered in FP8; None: every
    # parameter is all-gathered in param_dtype.
    fp8_weight_min_numel: int | None = None
    optimizer_instances: int = 1  # ParallelPlan.distributed_optimizer_instances

    def gather_nbytes(self, block: Block, numels: tuple[int, ...]) -> tuple[int, ...]:
        """Bytes per element of the all-gather of each of ``numels``, parameters of ``block``."""
        fp8 = self.fp8_weight_min_numel is not None and block.kind is BlockKind.LAYER
        return tuple(Dtype.FP8.nbytes if fp8 and n > self.fp8_weight_min_numel else self.param_dtype.nbytes
                     for n in numels)

    def nodes(self, stage: StageGraph) -> tuple[CollectiveNode, ...]:
        """All of them as graph nodes (DP and expert-DP collectives per block, by module), for reports."""
        dp: list[CollectiveNode] = []
        for group, size, per_block in ((ParallelGroup.DP, self.dp_group_size, self.dp_grad_nbytes),
                                       (ParallelGroup.EXPERT_DP, self.expert_dp_group_size, self.expert_dp_grad_nbytes)):
            for block, nbytes in zip(stage.blocks, per_block):
                if not nbytes:
                    continue
                if self.distributed_optimizer:
                    intra, inter = instance_groups(group, self.optimizer_instances)
                    shard = size // self.optimizer_instances
                    dp.append(self._dp(CollectiveKind.REDUCE_SCATTER, nbytes, Phase.BACKWARD, block.name,
                                       self.grad_dtype, intra, shard))
                    if inter is not None:
                        dp.append(self._dp(CollectiveKind.ALL_REDUCE, nbytes // shard, Phase.BACKWARD, block.name,
                                           self.grad_dtype, inter, self.optimizer_instances))
                    numels = block.parameter_sizes if group is ParallelGroup.DP else block.expert_parameter_numels
                    params = sum(n * b for n, b in zip(numels, self.gather_nbytes(block, numels)))
                    dp.append(self._dp(CollectiveKind.ALL_GATHER, params, Phase.OPTIMIZER, block.name,
                                       self.param_dtype, intra, shard))
                else:
                    dp.append(self._dp(CollectiveKind.ALL_REDUCE, nbytes, Phase.BACKWARD, block.name, self.grad_dtype,
                                       group, size))
        return tuple(dp) + self.embedding_sync + self.p2p

    def group_size(self, group: ParallelGroup) -> int:
        """Size of the group gradients are reduced over: DP, or expert DP."""
        return self.expert_dp_group_size if group is ParallelGroup.EXPERT_DP else self.dp_group_size

    @staticmethod
    def _dp(kind: CollectiveKind, nbytes: int, phase: Phase, module: str, dtype: Dtype, group: ParallelGroup,
            size: int) -> CollectiveNode:
        return CollectiveNode(kind=kind, nbytes=nbytes, group=group, group_size=size,
                              phase=phase, module=module, dtype=dtype.torch_name, synthesized=True)

    @property
    def sends(self) -> tuple[CollectiveNode, ...]:
        return tuple(n for n in self.p2p if n.kind is CollectiveKind.SEND)


def instance_groups(group: ParallelGroup, instances: int) -> tuple[ParallelGroup, ParallelGroup | None]:
    """The groups the distributed optimizer reduce-scatters (and all-gathers) over, and all-reduces
    the shards over, for the gradients reduced over ``group`` (DP or expert DP): ``group`` itself and
    None in one instance."""
    if instances == 1:
        return group, None
    if group is ParallelGroup.DP:
        return ParallelGroup.DP_INTRA, ParallelGroup.DP_INTER
    return ParallelGroup.EXPERT_DP_INTRA, ParallelGroup.EXPERT_DP_INTER


def runtime_collectives(stage: StageGraph, plan: ParallelPlan, *, dtype: Dtype, tied_embeddings: bool,
                        distributed_optimizer: bool = False, grads: Dtype | None = None,
                        fp8_param_gather: bool = False) -> RuntimeCollectives:
    """The runtime collectives of ``stage`` under ``plan`` for a model of ``dtype`` whose gradients
    are reduced in ``grads`` (None: :func:`grad_dtype`), see the module doc."""
    dp, edp = plan.grad_reduce_group_size, plan.expert_data_parallel
    grads = grads or grad_dtype(dtype)
    nbytes = tuple((block.num_parameters - block.num_expert_parameters) * grads.nbytes if dp > 1 else 0
                   for block in stage.blocks)
    expert = tuple(block.num_expert_parameters * grads.nbytes if edp > 1 else 0 for block in stage.blocks)
    sync = _embedding_sync(stage, plan, grads, tied_embeddings)
    return RuntimeCollectives(dp_grad_nbytes=nbytes, dp_group_size=dp, expert_dp_grad_nbytes=expert,
                              expert_dp_group_size=edp, grad_dtype=grads, param_dtype=dtype,
                              distributed_optimizer=distributed_optimizer, embedding_sync=sync, p2p=_p2p(stage, plan),
                              shared_embedding_param=_shared_embedding_param(stage, sync),
                              fp8_weight_min_numel=_FP8_WEIGHT_MIN_HIDDENS * stage.activation_shape[-1]
                              if fp8_param_gather and stage.activation_shape else None,
                              optimizer_instances=plan.distributed_optimizer_instances)


def _shared_embedding_param(stage: StageGraph, sync: tuple[CollectiveNode, ...]) -> int | None:
    """The word embedding is the first parameter of the first stage (``named_parameters`` starts
    with the embedding), the output weight the last of the last stage."""
    if not sync:
        return None
    sizes = [n for block in stage.blocks for _ in range(block.count) for n in block.parameter_sizes]
    index = 0 if sync[0].module == WORD_EMBEDDING else len(sizes) - 1
    assert sizes[index] == stage.word_embedding_parameters, "the shared embedding is not where megatron-core puts it"
    return index


def _embedding_sync(stage: StageGraph, plan: ParallelPlan, dtype: Dtype, tied: bool) -> tuple[CollectiveNode, ...]:
    if not (tied and plan.pipeline_parallel > 1 and stage.word_embedding_parameters):
        return ()
    kinds = {b.kind for b in stage.blocks}
    if BlockKind.EMBEDDING in kinds:
        module = WORD_EMBEDDING
    elif BlockKind.HEAD in kinds:
        module = OUTPUT_LAYER
    else:
        return ()
    return (CollectiveNode(kind=CollectiveKind.ALL_REDUCE, nbytes=stage.word_embedding_parameters * dtype.nbytes,
                           group=ParallelGroup.EMBEDDING, group_size=2, phase=Phase.BACKWARD, module=module,
                           dtype=dtype.torch_name, synthesized=True),)


def _p2p(stage: StageGraph, plan: ParallelPlan) -> tuple[CollectiveNode, ...]:
    pp = plan.pipeline_parallel
    if pp == 1:
        return ()
    virtual = stage.chunk * pp + stage.pipeline_rank
    first, last = virtual == 0, virtual == plan.num_model_chunks - 1
    nbytes = math.prod(stage.activation_shape) * element_nbytes(stage.activation_dtype)

    def node(kind: CollectiveKind, phase: Phase, module: str) -> CollectiveNode:
        return CollectiveNode(kind=kind, nbytes=nbytes, group=ParallelGroup.PP, group_size=pp, phase=phase,
                              module=module, dtype=stage.activation_dtype, synthesized=True)

    nodes = []
    if not first:
        nodes.append(node(CollectiveKind.RECV, Phase.FORWARD, "pipeline.recv_forward"))
    if not last:
        nodes.append(node(CollectiveKind.SEND, Phase.FORWARD, "pipeline.send_forward"))
        nodes.append(node(CollectiveKind.RECV, Phase.BACKWARD, "pipeline.recv_backward"))
    if not first:
        nodes.append(node(CollectiveKind.SEND, Phase.BACKWARD, "pipeline.send_backward"))
    return tuple(nodes)
