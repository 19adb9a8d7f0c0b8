"""Where megatron-core's MoE dispatch makes the host wait, on a small real megatron-core MoE traced on
the fake process group (EP 2): before the dispatch all-to-all with the all-to-all dispatcher, before
the experts with the all-gather one, in forward and recompute only; and the exact host/device
arithmetic of a wait (the host time after it is no longer hidden)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vtrain_plugin.core.graph import Phase
from vtrain_plugin.cost.host_syncs import all_to_all_rows, dispatch_waits
from vtrain_plugin.cost.kernels.host_device import Segment, SegmentTime, segment_times, sequence, split_times, then
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, TokenDispatcher
from vtrain_plugin.specs.training import SoftwareStack

H = 64
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=32, vocab_size=256,
                dtype="bf16", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=H)
PLAN = ParallelPlan(expert_parallel=2, data_parallel=2, micro_batch_size=2)


@pytest.fixture(scope="module")
def role():
    from vtrain_plugin.capture.tracer import trace

    prepared = prepare(trace(MOE, PLAN), stack=SoftwareStack.MEGATRON_CORE_LOCAL)
    return prepared.stages[0].role


def _waits(role, plan):
    modules = [n.module if n is not None else "" for n in role.nodes]
    for c in role.comm_rows:
        modules[c.row] = c.node.module
    return modules, dispatch_waits(modules, all_to_all_rows(role.comm_rows), role.segments, MOE, plan)


def test_the_all_to_all_dispatcher_waits_before_its_all_to_all(role):
    modules, waits = _waits(role, PLAN)
    layers = [i for i, s in enumerate(role.segments) if s.phase is Phase.FORWARD and
              any(".mlp.experts" in modules[r] for r in range(s.start, s.stop))]
    assert layers and sorted(waits) == layers  # one wait per MoE layer forward, none in the backward
    a2a = all_to_all_rows(role.comm_rows)
    for i in layers:
        (row,) = waits[i]
        s = role.segments[i]
        assert row in a2a and s.start < row < s.stop
        assert not any(".mlp.experts" in modules[r] for r in range(s.start, row))  # the dispatch, first


def test_the_all_gather_dispatcher_waits_before_the_experts(role):
    modules, waits = _waits(role, replace(PLAN, moe_token_dispatcher=TokenDispatcher.ALLGATHER))
    for i, (row,) in waits.items():
        assert ".mlp.experts" in modules[row] and ".mlp.experts" not in modules[row - 1]
    assert _waits(role, replace(PLAN, expert_parallel=1, data_parallel=4))[1].keys() == waits.keys()
    dense = replace(MOE, num_experts=None, moe_router_topk=None, moe_ffn_hidden_size=None)
    modules, _ = _waits(role, PLAN)
    assert dispatch_waits(modules, all_to_all_rows(role.comm_rows), role.segments, dense, PLAN) == {}


def test_a_wait_exposes_the_host_time_after_it():
    host = np.array([4.0, 4.0, 4.0, 4.0])
    device = np.array([10.0, 1.0, 1.0, 10.0])
    segment = Segment(block=0, phase=Phase.FORWARD, start=0, stop=4, count=1)
    # no wait: P = max(4 + 22, 8 + 21, 12 + 11, 16 + 10) = 29; waiting before row 2: the pieces
    # (8, 11, 15) and (8, 11, 18) run one after the other: 15 + 18 = 33
    pieces = split_times(host, device, segment, (2,))
    assert pieces == ((8.0, 11.0, 15.0), (8.0, 11.0, 18.0))
    plain = SegmentTime(16.0, 22.0, 29.0, 2)
    waited = SegmentTime(16.0, 22.0, 33.0, 2, pieces=pieces)
    assert sequence([plain]) == 29.0 + 22.0
    # two instances: the first ends at 33 (host at 23); the next one's first piece queues behind it
    # (max(33 + 11, 23 + 15) = 44), the host waits again and the last piece takes its 18
    assert sequence([waited]) == 33.0 + 11.0 + 18.0
    # then(): a wait in the second part stays a wait in the joined unit
    joined = then(SegmentTime(2.0, 3.0, 5.0, 1), replace(waited, count=1))
    assert joined.pieces[1:] == pieces[1:] and joined.pipelined_ns == sequence([joined])


def test_the_last_piece_is_timed_over_its_own_rows():
    # a forward segment (rows 0-3) followed by host-heavy rows of another phase: waiting before row
    # 2, the last piece runs rows 2-3 alone, max(4 + 11, 8 + 1) = 15, whatever comes after it
    host = np.array([4.0, 4.0, 4.0, 4.0, 100.0, 100.0])
    device = np.array([10.0, 1.0, 10.0, 1.0, 1.0, 1.0])
    segment = Segment(block=0, phase=Phase.FORWARD, start=0, stop=4, count=1)
    assert split_times(host, device, segment, (2,)) == ((8.0, 11.0, 15.0), (8.0, 11.0, 15.0))
    later = Segment(block=0, phase=Phase.BACKWARD, start=4, stop=6, count=1)
    first = Segment(block=0, phase=Phase.FORWARD, start=0, stop=2, count=1)
    _, _, p = segment_times(host, device, [first, later])  # segments that leave rows 2-3 out
    assert p.tolist() == [15.0, 201.0]


def test_a_recompute_waits_only_where_it_routes_again():
    from vtrain_plugin.capture.tracer import trace

    full = prepare(trace(MOE, replace(PLAN, recompute="full")), stack=SoftwareStack.MEGATRON_CORE_LOCAL).stages[0].role
    _, waits = _waits(full, PLAN)
    phases = sorted(full.segments[i].phase.value for i in waits)
    assert phases == ["forward", "recompute"]  # the layer template: both layers
