"""What megatron-core's fused vocabulary-parallel cross entropy holds at its peak beyond the unfused
one the trace runs (``--cross-entropy-loss-fusion``, ``fused_vocab_parallel_cross_entropy``).

Its forward runs ``calculate_logits_max`` and ``calculate_predicted_logits`` compiled
(``megatron.core.jit.jit_fuser``, ``torch.compile``): the first returns the fp32 copy of the logits
as a new tensor, and the second's in-place ``-=`` and ``exp(out=)`` on that input are functionalised
into a new fp32 buffer copied back into it, so while it runs the model-dtype logits, the fp32 logits
and that buffer are alive at once: one fp32 copy of the logits more than the unfused forward, whose
in-place ops make none. Why: on the last pipeline stage of a small model that forward is the step's
peak (the H100 functional test ``gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion`` measures 0.381
GiB above its unfused twin; this is 0.385 GiB there).
"""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.core.graph import Node, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import numel, op_name

FP32_NBYTES = 4


def fused_cross_entropy_extra_nbytes(nodes: Sequence[Node]) -> int:
    """Bytes per micro-batch the fused cross entropy's forward holds beyond the traced unfused one:
    one fp32 copy of the logits (the input of the loss's forward ``exp``); 0 without a loss."""
    return max((FP32_NBYTES * numel(n.key.input_shapes[0]) for n in nodes
                if isinstance(n, OpNode) and n.phase is Phase.FORWARD and op_name(n) == "exp"
                and n.module.rpartition(".")[2] == "loss"), default=0)
