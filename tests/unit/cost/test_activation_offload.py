"""Fine-grained activation offloading on a real traced Llama layer (local spec, bf16): the bytes each
--offload-modules name moves, exactly, under the local spec and TransformerEngine's kept tensors; the
size floor and fraction; the offload groups in forward order with the backward that hides each
reload; the exposed copy time; and the direction memory moves."""

from __future__ import annotations

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import BlockKind, Phase
from vtrain_plugin.cost.activation_offload import (exposed_copy_ns, exposed_reload_ns, offload_groups, offloaded_by_module,
                                                   offloaded_nbytes)
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.specs.activation_offload import ActivationOffload
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack, TrainingSpec

H, HEADS, S, MB = 64, 4, 32, 2
SBH_BYTES = S * MB * H * 2  # one bf16 hidden-sized tensor
NORM_STATS = 4 * S * MB  # TE's fp32 rstd per row of an RMSNorm


@pytest.fixture(scope="module")
def graph():
    from vtrain_plugin.capture.tracer import trace

    model = ModelSpec(family="llama", num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                      vocab_size=256, dtype="bf16")
    return trace(model, ParallelPlan(micro_batch_size=MB))


def _moved(graph, *modules, te=False, **kw) -> float:
    layer = graph.stages[0].layer_template()
    return offloaded_nbytes(layer, ActivationOffload(modules=modules, **kw), te=te, element_nbytes=2)


def test_each_name_moves_what_its_module_keeps(graph):
    # local spec: linear_qkv keeps its input, the norm output; attn_proj's linear its input
    assert _moved(graph, "qkv_linear", min_tensor_elements=1) == SBH_BYTES
    both = _moved(graph, "core_attn", "attn_proj", min_tensor_elements=1)
    assert both - _moved(graph, "core_attn", min_tensor_elements=1) == SBH_BYTES
    # TE: the attention norm is fused into linear_qkv, so qkv_linear's context holds its input and rstd;
    # attn_norm and a dense layer's mlp_norm (fused into fc1) move nothing
    assert _moved(graph, "qkv_linear", te=True, min_tensor_elements=1) == 2 * SBH_BYTES + NORM_STATS
    assert _moved(graph, "attn_norm", "mlp_norm", te=True, min_tensor_elements=1) == 0
    assert _moved(graph, "attn_norm", te=False, min_tensor_elements=1) > 0


def test_size_floor_and_fraction(graph):
    elements = SBH_BYTES // 2
    assert _moved(graph, "qkv_linear", min_tensor_elements=elements) == SBH_BYTES
    assert _moved(graph, "qkv_linear", min_tensor_elements=elements + 1) == 0
    assert _moved(graph, "qkv_linear") == 0  # megatron-core's 1M-element default: nothing this small
    assert _moved(graph, "qkv_linear", min_tensor_elements=1, fraction=0.5) == SBH_BYTES / 2


def test_exposed_copy_time():
    assert exposed_copy_ns(64_000, 400.0, 64.0) == 600.0  # 64 kB at 64 GB/s: 1000 ns beside 400 ns
    assert exposed_copy_ns(64_000, 2000.0, 64.0) == 0.0


def test_reloads_hide_only_behind_the_backward_between_groups(graph):
    layer = graph.stages[0].layer_template()
    offload = ActivationOffload(modules=("qkv_linear", "core_attn", "attn_proj"), min_tensor_elements=1)
    by_module = offloaded_by_module(layer, offload, te=False, element_nbytes=2)
    assert sum(by_module.values()) == _moved(graph, "qkv_linear", "core_attn", "attn_proj", min_tensor_elements=1)
    forward = list(dict.fromkeys(n.module for n in layer.nodes if n.phase is Phase.FORWARD))
    groups = offload_groups(forward, by_module)
    p = "decoder.layers.0."
    # qkv's reload hides behind the attention's own ops before core attention (rotary, split); core
    # attention's (its internals one group) behind nothing: attn_proj's context follows at once;
    # attn_proj's behind the MLP and, round the layer, the next layer's input norm
    assert [hiding for _, hiding in groups] == [
        [p + "self_attention"], [],
        [p[:-1], p + "pre_mlp_layernorm", p + "mlp.linear_fc1", p + "mlp", p + "mlp.linear_fc2", p + "input_layernorm"]]
    assert [nbytes for nbytes, _ in groups] == [SBH_BYTES, by_module[p + "self_attention.core_attention"], SBH_BYTES]
    backward = {p + "self_attention": 100.0, p + "mlp.linear_fc1": 50.0, p + "mlp.linear_fc2": 60.0}
    # at 1 byte/ns: qkv 8192 - 100, core attention whole, attn_proj 8192 - 110
    assert exposed_reload_ns(groups, backward, 1.0) == (SBH_BYTES - 100) + groups[1][0] + (SBH_BYTES - 110)


def test_offloading_lowers_activation_memory_by_the_moved_bytes(graph):
    def peak(training):
        return stack_rank_memory(graph, lambda rank, chunks, rises: (sum(chunks) * 4 + max(rises), 4), SoftwareStack.MEGATRON_CORE_TE,
                                 training)[0]
    base = peak(TrainingSpec(global_batch_size=8))
    offload = ActivationOffload(modules=("qkv_linear", "core_attn", "attn_proj"), min_tensor_elements=1)
    off = peak(TrainingSpec(global_batch_size=8, activation_offload=offload))
    moved = _moved(graph, "qkv_linear", "core_attn", "attn_proj", te=True, min_tensor_elements=1)
    # 2 layers x 4 micro-batches offloaded, one layer's worth kept back
    assert off.activations_gib < base.activations_gib
    assert (base.activations_gib - off.activations_gib) * 2**30 == pytest.approx(2 * 4 * moved - moved)


def test_a_blocks_backward_rises_once_the_blocks_after_it_freed_their_stash(graph):
    """What a stack adds in one block's backward (a reloaded group, TE's unfused score gradient)
    stands beside the stash of that block and those before it: the head's is gone by a layer's."""
    from vtrain_plugin.cost.memory import backward_rise

    blocks = graph.stages[0].blocks
    kinds = [b.kind for b in blocks]
    assert kinds[0] is BlockKind.EMBEDDING and kinds[-1] is BlockKind.HEAD
    layer_at = kinds.index(BlockKind.LAYER)
    layers, head = blocks[layer_at], blocks[-1]
    assert layers.count == 2 and layer_at == len(blocks) - 2

    def extras(**at: int) -> list[int]:
        where = {"embedding": 0, "layers": layer_at, "head": len(blocks) - 1}
        return [next((n for name, n in at.items() if where[name] == k), 0) for k in range(len(blocks))]

    step = 1000
    assert backward_rise(blocks, step, extras()) == step
    assert backward_rise(blocks, step, extras(head=7)) == step + 7  # the head's, with every stash in place
    # the layers' first instance back-propagates after the head freed its stash; both instances hold theirs
    assert backward_rise(blocks, step, extras(layers=head.activation_nbytes + 7)) == step + 7
    assert backward_rise(blocks, step, extras(layers=head.activation_nbytes - 7)) == step
    after_embedding = sum(b.count * b.activation_nbytes for b in blocks[1:])
    assert backward_rise(blocks, step, extras(embedding=after_embedding + 9, head=5)) == step + 9


def test_settings_validate_and_round_trip():
    spec = TrainingSpec(global_batch_size=8, activation_offload={"modules": ["core_attn", "attn_proj"], "fraction": 0.5})
    again = TrainingSpec(global_batch_size=8, activation_offload=spec.to_dict()["activation_offload"])
    assert again.activation_offload == spec.activation_offload == ActivationOffload(
        modules=("core_attn", "attn_proj"), fraction=0.5)
    for bad in ({"modules": ["attn_proj"]}, {"modules": ["mlp"]}, {"modules": []}, {"modules": ["core_attn"], "fraction": 2},
                {"modules": ["core_attn"], "size": 1}):
        with pytest.raises(ConfigError, match="training.activation_offload"):
            TrainingSpec(global_batch_size=8, activation_offload=bad)
