"""What megatron-core's loss and output layer hold beyond the step the trace runs: the fused
vocabulary-parallel cross entropy (``--cross-entropy-loss-fusion``) and the output layer's deferred
weight gradients (``--defer-embedding-wgrad-compute``, :func:`deferred_wgrad_nbytes`).

Its forward runs ``calculate_logits_max`` and ``calculate_predicted_logits`` compiled
(``megatron.core.jit.jit_fuser``, ``torch.compile``): the first returns the fp32 copy of the logits
as a new tensor, and the second's in-place ``-=`` and ``exp(out=)`` on that input are functionalised
into a new fp32 buffer copied back into it, so while it runs the model-dtype logits, the fp32 logits
and that buffer are alive at once: one fp32 copy of the logits more than the unfused forward, whose
in-place ops make none. That is a moment of the forward, apart from the backward's peak (where the
model-dtype logits are gone and their gradient is alive): the larger of the two counts. Why: on the last pipeline stage of a small model that forward is the step's
peak (the H100 functional test ``gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion`` measures 0.381
GiB above its unfused twin; this is 0.385 GiB there).
"""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.core.graph import Block, Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import numel, op_name

FP32_NBYTES = 4


def logits_numel(nodes: Sequence[Node]) -> int:
    """Elements of one micro-batch's logits on this rank (the input of the loss's forward ``exp``;
    the largest of several losses); 0 without a loss."""
    return max((numel(n.key.input_shapes[0]) for n in nodes
                if isinstance(n, OpNode) and n.phase is Phase.FORWARD and op_name(n) == "exp"
                and n.module.rpartition(".")[2] == "loss"), default=0)


def fused_cross_entropy_forward_nbytes(nodes: Sequence[Node], dtype_nbytes: int) -> int:
    """Bytes per micro-batch the fused cross entropy's forward holds beside the stash (which has the
    fp32 logits it saves): the model-dtype logits it was given and the compiled helper's fp32 buffer;
    0 without a loss."""
    return (dtype_nbytes + FP32_NBYTES) * logits_numel(nodes)


def deferred_wgrad_nbytes(block: Block, dtype_nbytes: int, microbatches: int, limit: int) -> int:
    """Bytes the last pipeline stage holds for the output layer's deferred weight gradients
    (``--defer-embedding-wgrad-compute``) beside the micro-batch it back-propagates last: each earlier
    deferred micro-batch's logits gradient (the model dtype, what the loss's backward hands the
    output layer) and the output layer's input (what it saved, kept in megatron-core's
    ``embedding_activation_buffer``) until the pipeline flush drains them; ``limit``: Megatron's
    ``wgrad_deferral_limit`` (0: every micro-batch deferred); 0 for a block without a loss."""
    logits = logits_numel(block.nodes)
    if not logits:
        return 0
    held = microbatches - 1 if limit == 0 else min(limit, microbatches - 1)
    saved_input = sum(nbytes for module, nbytes in block.saved_by_module
                      if module.rpartition(".")[2] == "output_layer")
    return held * (logits * dtype_nbytes + saved_input)
