"""megatron-core's MoE dispatchers copy their device-side token counts to the host once per MoE layer
forward, and the trace holds those copies: the all-to-all dispatcher's at its D2H point (the counts
per expert, the EP splits, the expert-TP splits and, with several local experts, the counts per local
expert), the all-gather dispatcher's one ``.cpu()``; a dispatcher padded to capacity copies none."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vtrain_plugin.core.graph import BlockKind, CollectiveNode, OpNode, Phase
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, TokenDispatcher

H = 64
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=32, vocab_size=256,
                dtype="bf16", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=H)
PLAN = ParallelPlan(expert_parallel=2, data_parallel=2, micro_batch_size=2)
COPY = "aten._to_copy.default"


def _layer(model: ModelSpec, plan: ParallelPlan):
    from vtrain_plugin.capture.tracer import trace

    graph = trace(model, plan)
    return next(b for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)


def _count_copies(block, phase: Phase) -> list[str]:
    """The dispatcher's copies of ``phase``: the ``_to_copy`` ops of token counts (int64) in the MoE
    layer's own module (the padded dispatcher casts its boolean routing map there)."""
    return [n for n in block.nodes if isinstance(n, OpNode) and n.phase is phase and n.op == COPY
            and n.module.endswith(".mlp") and n.key.dtypes[0] == "int64"]


@pytest.mark.parametrize("ep, copies", [(2, 5), (1, 2)])
def test_the_all_to_all_dispatcher_copies_its_counts_before_its_all_to_all(ep, copies):
    block = _layer(MOE, replace(PLAN, expert_parallel=ep, data_parallel=4 // ep))
    # EP 2: counts per local expert, input and output splits, expert-TP splits, counts per local
    # expert and source rank; EP 1: the first and the last only
    assert len(_count_copies(block, Phase.FORWARD)) == copies
    assert _count_copies(block, Phase.BACKWARD) == []
    forward = [n for n in block.nodes if n.phase is Phase.FORWARD]
    last_copy = max(i for i, n in enumerate(forward) if n in _count_copies(block, Phase.FORWARD))
    experts = min(i for i, n in enumerate(forward) if ".mlp.experts" in n.module)
    assert last_copy < experts
    if ep > 1:
        a2a = min(i for i, n in enumerate(forward) if isinstance(n, CollectiveNode) and n.kind.value == "all_to_all")
        assert last_copy < a2a


def test_the_all_gather_dispatcher_copies_its_counts_once():
    block = _layer(MOE, replace(PLAN, moe_token_dispatcher=TokenDispatcher.ALLGATHER))
    assert len(_count_copies(block, Phase.FORWARD)) == 1


def test_a_dispatcher_padded_to_capacity_copies_nothing():
    padded = replace(MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert _count_copies(_layer(padded, PLAN), Phase.FORWARD) == []
