"""megatron_adapters.conventions: megatron-core's module paths and rank order, checked by hand."""

import pytest

from megatron_adapters.fake_world import representative_rank
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import ParallelGroup as G
from megatron_adapters.conventions import (HEAD_MODULES, RANK_ORDER, TIED_WEIGHT_OWNERS, global_rank,
                                         is_core_attention_module, is_embedding_module, is_head_module,
                                         is_layer_module, node_of, rank_strides, split_layer_module)
from vtrain_plugin.cost.comm.topology import Layout
from vtrain_plugin.specs.parallel import ParallelPlan

# -- module paths -----------------------------------------------------------------------------------

LAYER_MODULES = [
    ("decoder.layers.0", ("decoder.layers", 0, "")),
    ("decoder.layers.3.mlp.linear_fc1", ("decoder.layers", 3, ".mlp.linear_fc1")),
    ("decoder.layers.17.self_attention.core_attention", ("decoder.layers", 17, ".self_attention.core_attention")),
    ("layers.12", ("layers", 12, "")),
    ("layers.2.input_layernorm", ("layers", 2, ".input_layernorm")),
    ("model.module.decoder.layers.5.mlp", ("model.module.decoder.layers", 5, ".mlp")),
    # nested layers: the innermost index is the layer's
    ("decoder.layers.0.mlp.experts.layers.1.fc", ("decoder.layers.0.mlp.experts.layers", 1, ".fc")),
    ("decoder.layers.4.inner.layers.7", ("decoder.layers.4.inner.layers", 7, "")),
]

NON_LAYER_MODULES = ["", "embedding", "embedding.word_embeddings", "decoder", "decoder.final_layernorm",
                     "output_layer", "loss", "decoder.layers", "decoder.layers.", "decoder.layers.x.mlp",
                     "decoder.layers.3a", "decoder.layers.3a.mlp", "decoder.sublayers.0", "decoder.layers_0",
                     "layers", "layers.", "decoder.layers.-1"]


@pytest.mark.parametrize("name,parts", LAYER_MODULES)
def test_split_layer_module(name, parts):
    assert split_layer_module(name) == parts
    assert is_layer_module(name)
    prefix, index, rest = parts
    assert f"{prefix}.{index}{rest}" == name


@pytest.mark.parametrize("name", NON_LAYER_MODULES)
def test_non_layer_modules(name):
    assert split_layer_module(name) is None
    assert not is_layer_module(name)


def test_core_attention_modules():
    for name in ("decoder.layers.3.self_attention.core_attention",
                 "decoder.layers.3.self_attention.core_attention.scale_mask_softmax",
                 "decoder.layers.0.self_attention.core_attention.attention_dropout"):
        assert is_core_attention_module(name)
    for name in ("decoder.layers.3.self_attention", "decoder.layers.3.self_attention.linear_qkv",
                 "decoder.layers.3.self_attention.core_attention_x", "self_attention.core_attention", "loss"):
        assert not is_core_attention_module(name)


def test_mtp_layers_are_the_heads_not_folded_layers():
    for name in ("mtp", "mtp.layers.0", "mtp.layers.0.eh_proj", "mtp.layers.1.transformer_layer.mlp"):
        assert is_head_module(name) and not is_layer_module(name)
    assert is_core_attention_module("mtp.layers.0.transformer_layer.self_attention.core_attention")
    assert not is_core_attention_module("mtp.layers.0.transformer_layer.self_attention.linear_qkv")


def test_embedding_and_head_modules():
    assert HEAD_MODULES == ("decoder.final_layernorm", "decoder.final_norm", "output_layer", "loss", "mtp")
    assert TIED_WEIGHT_OWNERS == ("embedding.word_embeddings", "output_layer")
    for name in ("embedding", "embedding.word_embeddings", "embedding.position_embeddings",
                 "embedding.embedding_dropout"):
        assert is_embedding_module(name) and not is_head_module(name) and not is_layer_module(name)
    for name in ("decoder.final_layernorm", "decoder.final_norm", "output_layer", "loss", "mtp.layers.0"):
        assert is_head_module(name) and not is_embedding_module(name)
    for name in ("", "decoder", "decoder.layers.0.input_layernorm", "rotary_pos_emb", "optimizer"):
        assert not is_embedding_module(name) and not is_head_module(name)


# -- rank order -------------------------------------------------------------------------------------

# tp 2, dp 3, pp 2: global rank -> (tp, dp, pp) rank, enumerated by hand (tp fastest, then dp, then pp).
SIZES = {G.TP: 2, G.DP: 3, G.PP: 2}
COORDINATES = [
    (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0),
    (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1), (0, 2, 1), (1, 2, 1),
]


def test_rank_order():
    assert RANK_ORDER == (G.TP, G.CP, G.DP, G.PP)


def test_global_rank_on_a_small_grid():
    for rank, (tp, dp, pp) in enumerate(COORDINATES):
        assert global_rank({G.TP: tp, G.DP: dp, G.PP: pp}, SIZES) == rank
    assert global_rank({}, SIZES) == 0
    assert global_rank({G.PP: 1}, SIZES) == 6
    assert global_rank({G.DP: 2}, SIZES) == 4


def test_rank_strides():
    assert rank_strides(SIZES) == {G.TP: 1, G.CP: 2, G.DP: 2, G.PP: 6}
    assert rank_strides({G.PP: 4}) == {G.TP: 1, G.CP: 1, G.DP: 1, G.PP: 1}  # left-out dimensions have size 1
    assert rank_strides({G.TP: 8, G.PP: 16}) == {G.TP: 1, G.CP: 8, G.DP: 8, G.PP: 8}
    assert rank_strides({G.TP: 2, G.CP: 4, G.DP: 3}) == {G.TP: 1, G.CP: 2, G.DP: 8, G.PP: 24}


def test_global_rank_rejects_ranks_outside_the_grid():
    with pytest.raises(ConfigError, match=r"dp_rank must be in \[0, 3\), got 3"):
        global_rank({G.DP: 3}, SIZES)
    with pytest.raises(ConfigError, match=r"tp_rank must be in \[0, 2\), got -1"):
        global_rank({G.TP: -1}, SIZES)
    with pytest.raises(ConfigError, match=r"pp_rank must be in \[0, 1\), got 1"):
        global_rank({G.PP: 1}, {G.TP: 2})
    with pytest.raises(ConfigError, match="not embedding"):
        global_rank({G.EMBEDDING: 0}, SIZES)


def test_node_of():
    assert [node_of(rank, 4) for rank in range(12)] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert [node_of(rank, 8) for rank in range(12)] == [0] * 8 + [1] * 4


def test_adapter_and_topology_number_ranks_alike():
    plan = ParallelPlan(tensor_parallel=2, data_parallel=3, pipeline_parallel=2)
    layout = Layout(tensor_parallel=2, data_parallel=3, pipeline_parallel=2, gpus_per_node=4)
    for pp in range(2):
        assert representative_rank(plan, pp) == layout.rank(pp_rank=pp) == 6 * pp
    for rank, (tp, dp, pp) in enumerate(COORDINATES):
        assert layout.rank(tp_rank=tp, dp_rank=dp, pp_rank=pp) == rank


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 2, 2, 2), (1, 4, 2, 1), (4, 2, 1, 3), (2, 3, 2, 2)])
def test_layout_groups_are_megatron_cores(tp, cp, dp, pp):
    """Every group vtrain places is the one megatron-core's RankGenerator builds (order tp-cp-ep-dp-pp):
    TP, CP, PP, and the gradient group DP x CP ('dp-cp'), for the representative rank of each stage."""
    from megatron.core.parallel_state import RankGenerator

    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    layout = Layout(tensor_parallel=tp, context_parallel=cp, data_parallel=dp, pipeline_parallel=pp,
                    gpus_per_node=8)
    strides = rank_strides(layout.sizes)
    placed = {G.TP: (1, tp), G.CP: (strides[G.CP], cp), G.DP: (strides[G.CP], cp * dp), G.PP: (strides[G.PP], pp)}
    tokens = {G.TP: "tp", G.CP: "cp", G.DP: "dp-cp", G.PP: "pp"}
    for stage in range(pp):
        rank = layout.rank(pp_rank=stage)
        for group, token in tokens.items():
            (megatron,) = (g for g in generator.get_ranks(token) if rank in g)
            step, size = placed[group]
            start = 0 if group is G.PP else rank
            assert megatron == [start + step * i for i in range(size)], (group, stage)
            assert layout.placement(group, pipeline_rank=stage).size == size
