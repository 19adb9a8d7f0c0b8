"""TransformerEngine's grouped experts in FP8, on a small real megatron-core MoE traced on the fake
process group (4 local experts): ``split_quantize`` casts every expert's split with its own kernels
under current scaling and the block-scaled recipes, and all of them in one fused kernel under delayed
scaling; the GEMMs stay one grouped kernel per linear either way."""

from __future__ import annotations

from collections import Counter

import pytest

from vtrain_plugin.core.graph import BlockKind, OpNode, Phase
from vtrain_plugin.cost.lowering.fusion import op_name
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, Fp8Settings, SoftwareStack

H = 64
EXPERTS = 4
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=32, vocab_size=256,
                dtype="bf16", num_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=H)


@pytest.fixture(scope="module")
def layer():
    from vtrain_plugin.capture.tracer import trace

    graph = trace(MOE, ParallelPlan(data_parallel=2, micro_batch_size=2))
    return next(b for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)


def _expert_kernels(layer, recipe: Fp8Recipe, phase: Phase) -> Counter[str]:
    nodes = map_nodes(layer.nodes, SoftwareStack.MEGATRON_CORE_TE, Fp8Settings(format=Fp8Format.HYBRID, recipe=recipe),
                      grouped_experts=True)
    return Counter(op_name(n) for n in nodes if isinstance(n, OpNode) and n.phase is phase
                   and ".mlp.experts.linear_fc" in n.module)


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.BACKWARD])
def test_each_expert_split_is_cast_by_its_own_kernels_but_under_delayed_scaling(layer, phase):
    blockwise = _expert_kernels(layer, Fp8Recipe.BLOCKWISE, phase)
    assert blockwise["quantize_fp8_block"] == EXPERTS * 2  # the two linears' inputs, or their incoming gradients
    tensorwise = _expert_kernels(layer, Fp8Recipe.TENSORWISE, phase)
    assert tensorwise["compute_amax"] == tensorwise["cast_transpose"] and tensorwise["compute_amax"] % EXPERTS == 0
    assert tensorwise["compute_amax"] > 0
    delayed = _expert_kernels(layer, Fp8Recipe.DELAYED, phase)
    assert 0 < delayed["cast_transpose"] < EXPERTS
    for kernels in (blockwise, tensorwise, delayed):
        assert kernels["grouped_gemm"] == (2 if phase is Phase.FORWARD else 4)
