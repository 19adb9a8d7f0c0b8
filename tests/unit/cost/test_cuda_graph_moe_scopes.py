"""CUDA-graph scopes on a MoE layer, as megatron-core 0.16 captures them, on a small real megatron-core
MoE traced on the fake process group (EP 2, all-to-all dispatcher): ``mlp`` captures dense MLPs only,
``moe`` the whole MoE block, ``moe_router`` its norm and router, ``moe_preprocess`` with it the
dispatcher's preprocessing before the token all-to-all (but the copies of the token counts); the
dispatch, the experts and the combine stay eager."""

from __future__ import annotations

import numpy as np
import pytest

from vtrain_plugin.core.graph import BlockKind, Phase
from vtrain_plugin.cost.cuda_graphs import graphed_host_ns
from vtrain_plugin.cost.host_syncs import all_to_all_rows, host_copy_rows
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

H = 64
MOE = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=32, vocab_size=256,
                dtype="bf16", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=H)
PLAN = ParallelPlan(expert_parallel=2, data_parallel=2, micro_batch_size=2)
LAUNCH = 0.5


@pytest.fixture(scope="module")
def stage():
    from vtrain_plugin.capture.tracer import trace

    return prepare(trace(MOE, PLAN), stack=SoftwareStack.MEGATRON_CORE_LOCAL).stages[0]


def _host(stage, *scopes):
    """Each row's host cost (1 per row ungraphed) under ``scopes``, the rows' modules, and the MoE
    layer's forward and backward segments."""
    role = stage.role
    modules = [n.module if n is not None else "" for n in role.nodes]
    for c in role.comm_rows:
        modules[c.row] = c.node.module
    training = TrainingSpec(global_batch_size=4, cuda_graph_impl="transformer_engine", cuda_graph_scope=scopes)
    host = graphed_host_ns(np.ones(len(modules)), modules, role.segments, role.blocks, training, LAUNCH,
                           all_to_all_rows=all_to_all_rows(role.comm_rows), host_copy_rows=host_copy_rows(role.nodes))
    layer = [s for s in role.segments if role.blocks[s.block].kind is BlockKind.LAYER and s.stop > s.start
             and s.phase in (Phase.FORWARD, Phase.BACKWARD)]
    return host, modules, {s.phase: s for s in layer}


def _rows(s, modules, test):
    return [r for r in range(s.start, s.stop) if test(modules[r])]


def test_the_mlp_scope_leaves_a_moe_layer_eager_and_moe_captures_it_whole(stage):
    host, modules, seg = _host(stage, "mlp")
    assert all(host[r] == 1 for s in seg.values() for r in _rows(s, modules, lambda m: ".mlp" in m))
    host, modules, seg = _host(stage, "moe")
    for s in seg.values():
        captured = _rows(s, modules, lambda m: ".mlp" in m or ".pre_mlp_layernorm" in m)
        assert host[captured[0]] == LAUNCH and all(host[r] == 0 for r in captured[1:])


def test_the_router_scopes_capture_up_to_the_dispatch(stage):
    host, modules, seg = _host(stage, "moe_router")
    forward = seg[Phase.FORWARD]
    router = _rows(forward, modules, lambda m: ".mlp.router" in m or ".pre_mlp_layernorm" in m)
    own = _rows(forward, modules, lambda m: m.endswith(".mlp"))
    experts = _rows(forward, modules, lambda m: ".mlp.experts" in m)
    assert router and all(host[r] < 1 for r in router)
    assert all(host[r] == 1 for r in own + experts)

    host, modules, seg = _host(stage, "moe_router", "moe_preprocess")
    copies = host_copy_rows(stage.role.nodes)
    a2a = sorted(all_to_all_rows(stage.role.comm_rows))
    for phase, s in seg.items():
        in_segment = [r for r in a2a if s.start <= r < s.stop]
        before = (lambda r: r < in_segment[0]) if phase is not Phase.BACKWARD else (lambda r: r > in_segment[-1])
        own = [r for r in _rows(s, modules, lambda m: m.endswith(".mlp")) if r not in copies]
        assert any(before(r) for r in own) and all(host[r] < 1 for r in own if before(r))  # 0, or a launch
        assert all(host[r] == 1 for r in own if not before(r))
        assert all(host[r] == 1 for r in _rows(s, modules, lambda m: ".mlp.experts" in m))
        assert all(host[r] == 1 for r in in_segment)
    assert copies and all(host[r] == 1 for r in copies)


def test_a_multi_token_prediction_layer_is_captured_like_a_decoder_layer():
    from vtrain_plugin.capture.tracer import trace

    model = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=32, vocab_size=256,
                      dtype="bf16", mtp_num_layers=1)
    role = prepare(trace(model, ParallelPlan(data_parallel=2, micro_batch_size=2)),
                   stack=SoftwareStack.MEGATRON_CORE_LOCAL).stages[0].role
    modules = [n.module if n is not None else "" for n in role.nodes]
    for c in role.comm_rows:
        modules[c.row] = c.node.module
    training = TrainingSpec(global_batch_size=4, cuda_graph_impl="transformer_engine", cuda_graph_scope=("attn",))
    host = graphed_host_ns(np.ones(len(modules)), modules, role.segments, role.blocks, training, LAUNCH)
    forward = [r for s in role.segments if s.phase is Phase.FORWARD for r in range(s.start, s.stop)]
    attention = [r for r in forward if ".transformer_layer.self_attention" in modules[r]]
    outside = [r for r in forward if modules[r].startswith("mtp.") and ".transformer_layer." not in modules[r]]
    assert attention and all(host[r] < 1 for r in attention)
    assert outside and all(host[r] == 1 for r in outside)
