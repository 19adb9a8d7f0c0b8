"""A chunk's traces under full and selective recompute against its trace without recompute, op by op
(dense GPT and Llama layers, middle, whole and head roles): what they share exactly, and what keeps
a derivation of one from the other from being exact.

Shared: the embedding and head blocks; under selective recompute the bytes held beside the
activations and the backward peak outside core attention; every kernel and collective of a layer
(full: the forward's, again as the recompute, then the backward's and optimizer's; selective: the
forward's, the core attention's again as the recompute). Not derivable: the ops that launch nothing
(autograd queries a fake tensor's device only with grad on, so a checkpoint's no-grad forward has
fewer of them, in no pattern the trace shows; the checkpoint's own detaches and allocations), the
backward peaks (a recomputed layer's live bytes: no sum of traced fields matches them in every role),
the bytes held under full recompute (a rotary table the checkpoint saves is no longer held), and
selective recompute's backward copies of the detached query, key and value gradients.
Why: each recompute mode of a role is a trace job of its own (capture/tracer.py); these are the facts
a derivation that saves two of every three would have to rest on or work around.
"""

from dataclasses import replace

import pytest

from vtrain_plugin.capture.megatron_chunk import trace_chunk
from vtrain_plugin.core.graph import Block, CollectiveNode, OpNode, Phase
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

DENSE = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
LLAMA = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  seq_length=128, vocab_size=1024, dtype="bf16")
CASES = [  # (model, sequence parallel, pre_process, post_process)
    (DENSE, False, False, False),
    (DENSE, True, True, True),
    (LLAMA, True, False, True),
]
CORE_ATTENTION = ".core_attention"


def _traces(model, sp, pre, post):
    def traced(mode):
        plan = ParallelPlan(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=sp, micro_batch_size=2,
                            recompute=mode)
        return trace_chunk(model, plan, pre, post, 2)

    return traced("none"), traced("selective"), traced("full")


def _costed(block: Block, *phases: Phase) -> list:
    """The block's kernels and collectives in ``phases`` (what costing reads), in trace order."""
    return [n for n in block.nodes if (isinstance(n, CollectiveNode) or n.launches_kernel) and n.phase in phases]


def _as(nodes: list, phase: Phase) -> list:
    return [replace(n, phase=phase) for n in nodes]


@pytest.fixture(scope="module", params=CASES, ids=["gpt-middle", "gpt-sp-whole", "llama-sp-head"])
def traces(request):
    return _traces(*request.param)


def test_blocks_outside_the_layers_and_the_held_bytes_are_those_without_recompute(traces):
    none, selective, full = traces
    outside = [[b for b in t.blocks if b.name in ("embedding", "head")] for t in traces]
    assert outside[0] == outside[1] == outside[2]
    assert (selective.held_nbytes, selective.held_outside_attention_nbytes) == (
        none.held_nbytes, none.held_outside_attention_nbytes)
    assert selective.backward_peak_outside_attention_nbytes == none.backward_peak_outside_attention_nbytes
    assert full.backward_peak_nbytes > max(selective.backward_peak_nbytes, none.backward_peak_nbytes)


def test_a_layers_kernels_and_collectives_under_recompute_are_derived_from_those_without(traces):
    none, selective, full = traces
    layers = [{b.name: b for b in t.blocks if b.kind == "layer"} for t in traces]
    assert layers[0].keys() == layers[1].keys() == layers[2].keys() and len(layers[0]) == 2
    for name, block in layers[0].items():
        forward = _costed(block, Phase.FORWARD)
        after = _costed(block, Phase.BACKWARD, Phase.OPTIMIZER)
        assert any(isinstance(n, CollectiveNode) for n in forward)
        assert _costed(layers[2][name], Phase.FORWARD) == forward  # the no-grad forward runs the same kernels
        assert _costed(layers[2][name], Phase.RECOMPUTE) == _as(forward, Phase.RECOMPUTE)
        assert _costed(layers[2][name], Phase.BACKWARD, Phase.OPTIMIZER) == after
        assert _costed(layers[1][name], Phase.FORWARD) == forward
        assert _costed(layers[1][name], Phase.RECOMPUTE) == _as(
            [n for n in forward if CORE_ATTENTION in n.module], Phase.RECOMPUTE)
        # selective recompute's backward adds copies of the detached inputs' gradients: not derived
        extra = [n.key.op for n in _costed(layers[1][name], Phase.BACKWARD) if n not in after]
        assert extra and set(extra) <= {"aten.clone.default", "aten.copy_.default"}


def test_what_differs_beyond_kernels_the_reason_each_mode_is_traced(traces):
    none, selective, full = traces
    ours, theirs = (next(b for b in t.blocks if b.kind == "layer") for t in (none, full))
    quiet = [[n for n in b.nodes if isinstance(n, OpNode) and not n.launches_kernel and n.phase is Phase.FORWARD]
             for b in (ours, theirs)]
    assert len(quiet[1]) < len(quiet[0])  # device queries autograd makes only with grad on
    # full recompute keeps each layer's input alone, the backward peak holds a recomputed layer
    assert theirs.activation_nbytes < ours.activation_nbytes
    assert full.backward_peak_nbytes > none.backward_peak_nbytes + theirs.activation_nbytes
