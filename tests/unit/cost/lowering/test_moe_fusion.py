"""TE's fused MoE kernels (``--moe-permute-fusion``, ``--moe-router-fusion``) on a small real
megatron-core MoE layer traced on the fake process group: exact kernel counts and bytes with and
without each flag, the host copy the fused path drops, refusal without TE, and the flags read."""

from __future__ import annotations

from collections import Counter

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import BlockKind, OpNode, Phase
from vtrain_plugin.cost.lowering import moe_fusion as mf
from vtrain_plugin.cost.lowering.fusion import op_name
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.assumptions import moe_assumptions
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

H, EXPERTS, TOPK, MBS, SEQ = 64, 4, 2, 2, 32
TOKENS = MBS * SEQ  # per rank, no TP
ROWS = TOKENS * TOPK  # routed rows, balanced
BF16, FP32 = 2, 4
TE = "megatron_core_te"
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=SEQ, vocab_size=256,
                dtype="bf16", num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=H)


def _layer(dispatcher: str):
    from vtrain_plugin.capture.tracer import trace

    graph = trace(MOE, ParallelPlan(data_parallel=2, expert_parallel=2, micro_batch_size=MBS,
                                    moe_token_dispatcher=dispatcher))
    return next(b for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)


@pytest.fixture(scope="module")
def alltoall():
    return _layer("alltoall")


@pytest.fixture(scope="module")
def allgather():
    return _layer("allgather")


def _te(nodes, phase: Phase) -> dict[str, list[OpNode]]:
    out: dict[str, list[OpNode]] = {}
    for n in nodes:
        if isinstance(n, OpNode) and n.phase is phase and n.op.startswith("te.moe_"):
            out.setdefault(n.op, []).append(n)
    return out


def _mlp_ops(nodes, phase: Phase) -> Counter[str]:
    return Counter(op_name(n) for n in nodes if isinstance(n, OpNode) and n.phase is phase
                   and n.module.endswith(".mlp"))


def test_alltoall_permutation_is_one_te_kernel_per_permute_sort_and_unpermute(alltoall):
    plain = map_nodes(alltoall.nodes, TE)
    assert not _te(plain, Phase.FORWARD) and not _te(plain, Phase.BACKWARD)
    nodes = map_nodes(alltoall.nodes, TE, permute_fusion=True)
    fwd, bwd = _te(nodes, Phase.FORWARD), _te(nodes, Phase.BACKWARD)
    # one layer per block: permute (with probs), two sorts (dispatch with probs, combine), unpermute
    assert {op: len(ks) for op, ks in fwd.items()} == {mf.PERMUTE: 1, mf.SORT_CHUNKS: 2, mf.UNPERMUTE: 1}
    assert {op: len(ks) for op, ks in bwd.items()} == {mf.PERMUTE_BACKWARD: 1, mf.SORT_CHUNKS_BACKWARD: 2,
                                                       mf.UNPERMUTE_BACKWARD: 1}
    (permute,) = fwd[mf.PERMUTE]
    # the alltoall dispatcher permutes over every expert: the map is E x t
    assert permute.nbytes == 2 * ROWS * H * BF16 + TOKENS * EXPERTS * (mf.MAP + mf.ROW_ID) + 2 * ROWS * BF16
    assert permute.output_shapes == ((ROWS, H),)
    (unpermute,) = fwd[mf.UNPERMUTE]
    assert unpermute.nbytes == (ROWS + TOKENS) * H * BF16 + mf.ROW_ID * TOKENS * EXPERTS
    assert bwd[mf.UNPERMUTE_BACKWARD][0].nbytes == unpermute.nbytes
    (permute_bwd,) = bwd[mf.PERMUTE_BACKWARD]
    assert permute_bwd.nbytes == ((ROWS + TOKENS) * H * BF16 + mf.ROW_ID * TOKENS * EXPERTS
                                  + ROWS * BF16 + TOKENS * EXPERTS * BF16)
    sorts = sorted(k.nbytes for k in fwd[mf.SORT_CHUNKS])
    assert sorts == [2 * ROWS * H * BF16 + 2 * mf.ROW_ID * ROWS, 2 * ROWS * H * BF16 + 2 * mf.ROW_ID * ROWS
                     + 2 * ROWS * BF16]
    assert sorted(k.nbytes for k in bwd[mf.SORT_CHUNKS_BACKWARD]) == sorts
    # the unfused ops are gone from the MoE block's own module
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        left = _mlp_ops(nodes, phase)
        for op in ("nonzero_static", "index_select", "scatter_add_", "index_add", "gather", "cat", "arange"):
            assert left[op] == 0, (phase, op)


def test_fused_alltoall_drops_the_host_copy_of_the_per_local_expert_counts(alltoall):
    def copies(nodes):
        return sorted(n.key.input_shapes[0] for n in nodes if isinstance(n, OpNode) and n.phase is Phase.FORWARD
                      and n.module.endswith(".mlp") and op_name(n) == "_to_copy")

    plain, fused = copies(map_nodes(alltoall.nodes, TE)), copies(map_nodes(alltoall.nodes, TE, permute_fusion=True))
    assert (2, EXPERTS // 2) in plain  # [tp x ep, local experts]
    assert fused == [s for s in plain if s != (2, EXPERTS // 2)]


def test_allgather_permutes_tokens_only_and_keeps_its_masked_select_of_the_probs(allgather):
    nodes = map_nodes(allgather.nodes, TE, permute_fusion=True)
    fwd, bwd = _te(nodes, Phase.FORWARD), _te(nodes, Phase.BACKWARD)
    assert {op: len(ks) for op, ks in fwd.items()} == {mf.PERMUTE: 1, mf.UNPERMUTE: 1}
    assert {op: len(ks) for op, ks in bwd.items()} == {mf.PERMUTE_BACKWARD: 1, mf.UNPERMUTE_BACKWARD: 1}
    gathered, local = TOKENS * 2, EXPERTS // 2  # the all-gathered tokens over EP 2, the local experts' map
    rows = gathered * TOPK // 2  # the pairs routed to this rank's experts
    assert fwd[mf.PERMUTE][0].nbytes == 2 * rows * H * BF16 + gathered * local * (mf.MAP + mf.ROW_ID)
    assert bwd[mf.PERMUTE_BACKWARD][0].nbytes == (rows + gathered) * H * BF16 + mf.ROW_ID * gathered * local
    assert _mlp_ops(nodes, Phase.FORWARD)["nonzero_static"] == 1  # the probabilities' masked_select
    assert _mlp_ops(nodes, Phase.BACKWARD)["index_add"] == 1  # ... and its backward


def test_router_fusion_is_the_fused_top_k_scores_and_aux_loss_each_way(alltoall):
    plain = map_nodes(alltoall.nodes, TE)
    nodes = map_nodes(alltoall.nodes, TE, router_fusion=True)

    def router(ns, phase):
        return [n for n in ns if isinstance(n, OpNode) and n.phase is phase and n.module.endswith(".mlp.router")]

    fwd, bwd = router(nodes, Phase.FORWARD), router(nodes, Phase.BACKWARD)
    assert [op_name(n) for n in fwd if n.op.startswith("te.")] == [
        "fused_topk_with_score_function", "fused_score_for_moe_aux_loss", "fused_moe_aux_loss"]
    assert [op_name(n) for n in bwd if n.op.startswith("te.")] == [
        "fused_moe_aux_loss_backward", "fused_score_for_moe_aux_loss_backward",
        "fused_topk_with_score_function_backward"]
    n = TOKENS * EXPERTS
    assert [k.nbytes for k in fwd if k.op.startswith("te.")] == [
        n * (2 * BF16 + mf.MAP + FP32), n * (BF16 + mf.MAP + 2 * FP32), n * FP32 + 8 * EXPERTS + FP32]
    assert [k.nbytes for k in bwd if k.op.startswith("te.")] == [
        n * FP32 + 8 * EXPERTS + FP32, n * (2 * FP32 + BF16), n * (2 * BF16 + mf.MAP + FP32)]
    # kept: the gating GEMM and its two backward GEMMs, the count of tokens per expert, the logged
    # loss, autograd's sums of the logits' two gradients and of the input's (router and experts)
    assert Counter(op_name(k) for k in fwd if not k.op.startswith("te.")) == Counter(
        {"mm": 1, "sum": 1, "add_": 1, "copy_": 1})
    assert Counter(op_name(k) for k in bwd if not k.op.startswith("te.")) == Counter({"mm": 2, "add": 2})
    assert len(router(plain, Phase.FORWARD)) > len(fwd) and len(router(plain, Phase.BACKWARD)) > len(bwd)


@pytest.mark.parametrize("flag", ["permute_fusion", "router_fusion"])
def test_the_fused_moe_kernels_need_transformer_engine(alltoall, flag):
    with pytest.raises(ConfigError, match="megatron_core_te"):
        map_nodes(alltoall.nodes, "megatron_core_local", **{flag: True})


def test_megatron_flags_set_the_fusions_without_a_warning_and_name_them_as_assumptions():
    p = megatron_plan(read_command_line("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                                        "--micro-batch-size 1 --vocab-size 1000 --num-experts 4 "
                                        "--moe-permute-fusion --moe-router-fusion"), gpus=8)
    assert (p.model.moe_permute_fusion, p.model.moe_router_fusion) == (True, True)
    assert not any("fusion" in note for note in p.unmodelled)
    named = moe_assumptions(p.model, p.parallel)
    assert any(line.startswith("MoE permute fusion") for line in named)
    assert any(line.startswith("MoE router fusion") for line in named)
    assert not any("fusion" in line for line in moe_assumptions(MOE, ParallelPlan(data_parallel=2)))


def test_flex_permutes_with_probs_and_leaves_the_map_conversion_and_its_gradient_as_traced():
    from vtrain_plugin.capture.tracer import trace

    graph = trace(MOE, ParallelPlan(data_parallel=2, expert_parallel=2, micro_batch_size=MBS,
                                    moe_token_dispatcher="flex", moe_flex_dispatcher_backend="deepep"))
    layer = next(b for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)
    nodes = map_nodes(layer.nodes, TE, permute_fusion=True)
    fwd, bwd = _te(nodes, Phase.FORWARD), _te(nodes, Phase.BACKWARD)
    assert {op: len(ks) for op, ks in fwd.items()} == {mf.PERMUTE: 1, mf.UNPERMUTE: 1}
    assert {op: len(ks) for op, ks in bwd.items()} == {mf.PERMUTE_BACKWARD: 1, mf.UNPERMUTE_BACKWARD: 1}
    assert fwd[mf.PERMUTE][0].key.args == (("probs", True),)
    assert _mlp_ops(nodes, Phase.FORWARD)["scatter"] == 2  # the received indices as a map and its probs
    assert _mlp_ops(nodes, Phase.BACKWARD)["gather"] == 1  # the probs' scatter, backward
