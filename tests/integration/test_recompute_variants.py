"""A chunk's traces under full and selective recompute against its trace without recompute, op by op
(dense GPT and Llama, MoE, MLA and hybrid layers; middle, whole and head roles): what they share
exactly, and what keeps a derivation of one from the other from being exact.

Shared: the embedding and head blocks; every node of a layer's forward under full recompute (the
no-grad forward records what the forward with grad does: fake-tensor metadata queries, which autograd
makes only with grad on, are not recorded); every kernel and collective of a layer (full: the
forward's, again as the recompute, then the backward's and optimizer's; selective: the forward's, the
core attention's again as the recompute). Not derivable: the recompute's and the checkpoint's ops that
launch nothing (megatron-core's scratch buffer is allocated by its first user and sliced after, a
state of the process; the checkpoint's detaches and allocations), the backward peaks (a recomputed
layer's live bytes: no sum of traced fields matches them in every role), the bytes held under full
recompute (a rotary table the checkpoint saves is no longer held), and selective recompute's backward
copies of the detached query, key and value gradients.
Why: each recompute mode of a role is a trace job of its own (capture/tracer.py); these are the facts
a derivation that saves two of every three would have to rest on or work around.
"""

from dataclasses import replace

import pytest

from vtrain_plugin.capture.megatron_chunk import trace_chunk
from vtrain_plugin.core.graph import Block, CollectiveNode, OpNode, Phase
from vtrain_plugin.specs.hybrid import traced_kinds
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

DENSE = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
_SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024, dtype="bf16")
LLAMA = ModelSpec(family="llama", num_query_groups=2, **_SMALL)
MOE = ModelSpec(family="llama", num_query_groups=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=192,
                **_SMALL)
MLA = ModelSpec(family="llama", ffn_hidden_size=704, multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64,
                qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32, **_SMALL)
HYBRID = ModelSpec(**{**_SMALL, "num_layers": 3}, hybrid_layer_pattern="M*-", mamba_state_dim=16,
                   mamba_head_dim=32, mamba_num_groups=2, ffn_hidden_size=1024)
CASES = {  # (model, sequence parallel, pre_process, post_process)
    "gpt-middle": (DENSE, False, False, False),
    "gpt-sp-whole": (DENSE, True, True, True),
    "llama-sp-head": (LLAMA, True, False, True),
    "moe-sp-middle": (MOE, True, False, False),
    "mla-head": (MLA, False, False, True),
    "hybrid-middle": (HYBRID, False, False, False),
}
# where full recompute's kernels are the forward's, again as the recompute, and the backward's
DERIVED_FULL = ("gpt-middle", "gpt-sp-whole", "llama-sp-head")
CORE_ATTENTION = ".core_attention"


def _traces(model, sp, pre, post):
    built = len(traced_kinds(model.hybrid_layer_pattern)) if model.is_hybrid else 2

    def traced(mode):
        plan = ParallelPlan(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=sp, micro_batch_size=2,
                            recompute=mode)
        return trace_chunk(model, plan, pre, post, built)

    return traced("none"), traced("selective"), traced("full")


def _costed(block: Block, *phases: Phase) -> list:
    """The block's kernels and collectives in ``phases`` (what costing reads), in trace order."""
    return [n for n in block.nodes if (isinstance(n, CollectiveNode) or n.launches_kernel) and n.phase in phases]


def _as(nodes: list, phase: Phase) -> list:
    return [replace(n, phase=phase) for n in nodes]


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, _traces(*CASES[request.param])


def _layers(trace) -> dict[str, Block]:
    return {b.name: b for b in trace.blocks if b.kind == "layer"}


def _skipped(nodes: list, fewer: list) -> list:
    """The nodes of ``nodes`` that ``fewer`` lacks, ``fewer`` being ``nodes`` with some left out."""
    rest = iter(fewer)
    skipped, expected = [], next(rest, None)
    for n in nodes:
        if n == expected:
            expected = next(rest, None)
        else:
            skipped.append(n)
    assert expected is None, "not a subsequence"
    return skipped


def test_blocks_outside_the_layers_and_the_held_bytes_are_those_without_recompute(case):
    name, traces = case
    none, selective, full = traces
    outside = [[b for b in t.blocks if b.name in ("embedding", "head")] for t in traces]
    assert outside[0] == outside[1] == outside[2]
    assert (selective.held_nbytes, selective.held_outside_attention_nbytes) == (
        none.held_nbytes, none.held_outside_attention_nbytes)
    assert selective.backward_peak_outside_attention_nbytes == none.backward_peak_outside_attention_nbytes
    if name != "hybrid-middle":
        assert full.backward_peak_nbytes > max(selective.backward_peak_nbytes, none.backward_peak_nbytes)


def test_a_layers_kernels_under_selective_recompute_are_derived_from_those_without(case):
    _, (none, selective, _) = case
    layers = [_layers(t) for t in (none, selective)]
    assert layers[0].keys() == layers[1].keys() and len(layers[0]) in (2, 3)
    for name, block in layers[0].items():
        forward = _costed(block, Phase.FORWARD)
        assert any(isinstance(n, CollectiveNode) for n in forward)
        assert _costed(layers[1][name], Phase.FORWARD) == forward
        assert _costed(layers[1][name], Phase.RECOMPUTE) == _as(
            [n for n in forward if CORE_ATTENTION in n.module], Phase.RECOMPUTE)
        # selective recompute's backward adds copies of the detached inputs' gradients: not derived
        after = _costed(block, Phase.BACKWARD, Phase.OPTIMIZER)
        extra = [n.key.op for n in _costed(layers[1][name], Phase.BACKWARD) if n not in after]
        attends = any(CORE_ATTENTION in n.module for n in forward)
        assert bool(extra) == attends and set(extra) <= {"aten.clone.default", "aten.copy_.default"}


def test_a_dense_layers_kernels_under_full_recompute_are_derived_from_those_without(case):
    name, (none, _, full) = case
    if name not in DERIVED_FULL:
        pytest.skip("not derived: see the test below")
    layers = [_layers(t) for t in (none, full)]
    for name, block in layers[0].items():
        forward = _costed(block, Phase.FORWARD)
        assert _costed(layers[1][name], Phase.FORWARD) == forward  # the no-grad forward runs the same kernels
        assert _costed(layers[1][name], Phase.RECOMPUTE) == _as(forward, Phase.RECOMPUTE)
        assert _costed(layers[1][name], Phase.BACKWARD, Phase.OPTIMIZER) == _costed(
            block, Phase.BACKWARD, Phase.OPTIMIZER)
        # and the no-grad forward records every node the forward with grad does, views included
        assert [n for n in layers[1][name].nodes if n.phase is Phase.FORWARD] == [
            n for n in block.nodes if n.phase is Phase.FORWARD]


def test_where_megatron_core_makes_full_recompute_more_than_a_second_forward(case):
    name, (none, _, full) = case
    ours, theirs = _layers(none), _layers(full)
    if name == "moe-sp-middle":  # the router adds its load-balancing loss only with grad on
        for layer, block in ours.items():
            skipped = _skipped(_costed(block, Phase.FORWARD), _costed(theirs[layer], Phase.FORWARD))
            assert skipped and all(n.module.endswith(".mlp.router") for n in skipped)
    elif name == "mla-head":  # the recompute reads the rotary table the forward computed and cached
        for layer, block in ours.items():
            skipped = _skipped(_as(_costed(block, Phase.FORWARD), Phase.RECOMPUTE),
                               _costed(theirs[layer], Phase.RECOMPUTE))
            assert skipped and all(n.module.endswith(".rotary_pos_emb") for n in skipped)
    elif name == "hybrid-middle":  # megatron-core's MambaStack checkpoints no layer: the same trace
        assert full.to_dict() == none.to_dict()
    else:
        pytest.skip("derived: see the test above")


def test_what_differs_beyond_kernels_the_reason_each_mode_is_traced(case):
    name, (none, selective, full) = case
    if name == "hybrid-middle":
        pytest.skip("full recompute is no recompute here")
    ours, theirs = (next(iter(_layers(t).values())) for t in (none, full))
    # the checkpoint's own detaches and allocations: ops that launch nothing, outside any layer
    stage = [[n for b in t.blocks if b.kind == "stage" for n in b.nodes if isinstance(n, OpNode)]
             for t in (none, full)]
    assert len(stage[1]) > len(stage[0])
    assert all(not n.launches_kernel for n in stage[1] if n not in stage[0])
    # full recompute keeps each layer's input alone, the backward peak holds a recomputed layer
    assert theirs.activation_nbytes < ours.activation_nbytes
    assert full.backward_peak_nbytes > none.backward_peak_nbytes + theirs.activation_nbytes
