"""FP8 runs with their first and last decoder layers in bf16 (``--first-last-layers-bf16``): which
instances of which blocks leave FP8, and what that does to an estimate of a small real Llama."""

from __future__ import annotations

import pytest

from vtrain_plugin.core.graph import Block, BlockKind, StageGraph
from vtrain_plugin.cost.lowering.bf16_layers import bf16_edge_counts, split_bf16_layers
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, Fp8Settings


def _settings(start: int, end: int) -> Fp8Settings:
    return Fp8Settings(format=Fp8Format.HYBRID, recipe=Fp8Recipe.TENSORWISE, bf16_layers_at_start=start,
                       bf16_layers_at_end=end)


def _stage(*counts: int, embedding: bool = False) -> StageGraph:
    blocks = [Block(kind=BlockKind.EMBEDDING, name="embedding")] if embedding else []
    blocks += [Block(kind=BlockKind.LAYER, name=f"decoder.layers.{i}", count=c) for i, c in enumerate(counts)]
    return StageGraph(pipeline_rank=0, blocks=tuple(blocks))


@pytest.mark.parametrize("counts, first, start, end, expected", [
    ((8,), 1, 1, 1, ((0, 0), (1, 1))),  # the whole model on one stage: the first and the last layer
    ((4,), 1, 2, 1, ((0, 0), (2, 0))),  # first half of 8 layers
    ((4,), 5, 2, 1, ((0, 0), (0, 1))),  # second half
    ((4,), 3, 3, 0, ((0, 0), (1, 0))),  # layers 3-6: layer 3 (index 2) is below 3
    ((1, 3), 5, 0, 2, ((0, 0), (0, 0), (0, 2))),  # dense then MoE blocks: the last two are MoE
    ((2, 2), 1, 3, 0, ((0, 0), (2, 0), (1, 0))),
    ((8,), 1, 5, 5, ((0, 0), (5, 3))),  # overlapping ranges: every layer once
])
def test_bf16_instances_follow_megatron_cores_global_layer_index(counts, first, start, end, expected):
    assert bf16_edge_counts(_stage(*counts, embedding=True), first, 8, _settings(start, end)) == expected


def test_split_keeps_the_block_order_and_every_instance():
    stage = _stage(8, embedding=True)
    split, outside = split_bf16_layers(stage, ((0, 0), (1, 2)))
    assert [(b.kind, b.count) for b in split.blocks] == [(BlockKind.EMBEDDING, 1), (BlockKind.LAYER, 1),
                                                         (BlockKind.LAYER, 5), (BlockKind.LAYER, 2)]
    assert outside == (False, True, False, True)
    assert split_bf16_layers(stage, ((0, 0), (0, 0))) == (stage, (False, False))


@pytest.fixture(scope="module")
def llama_graph():
    from vtrain_plugin.capture.tracer import trace
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan

    model = ModelSpec(family="llama", num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      seq_length=4096, vocab_size=512, dtype="bf16")
    return trace(model, ParallelPlan(pipeline_parallel=2, data_parallel=4, micro_batch_size=2))


def test_bf16_edge_layers_are_slower_than_all_fp8_and_faster_than_bf16(llama_graph):
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.hardware.clusters import get_cluster_preset
    from vtrain_plugin.specs.training import TrainingSpec

    cluster = get_cluster_preset("dgx-h100")

    def time_ms(**fields):
        return estimate(llama_graph, cluster=cluster, training=TrainingSpec(
            global_batch_size=32, software_stack="megatron_core_te", **fields)).iteration_time_ms

    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
    all_fp8, edges, bf16 = time_ms(**fp8), time_ms(**fp8, fp8_bf16_layers_at_start=1, fp8_bf16_layers_at_end=1), time_ms()
    assert all_fp8 < edges < bf16
    assert time_ms(**fp8, fp8_bf16_layers_at_start=4) == pytest.approx(bf16, rel=0.02)  # only the casts' absence differs


def test_bf16_edge_layers_need_fp8_and_current_scaling():
    from vtrain_plugin.core.errors import ConfigError
    from vtrain_plugin.specs.training import TrainingSpec

    with pytest.raises(ConfigError, match=r"^training.fp8_bf16_layers_at_start requires training.fp8"):
        TrainingSpec(global_batch_size=8, fp8_bf16_layers_at_start=1)
    with pytest.raises(ConfigError, match=r"^training.fp8_bf16_layers_at_end with training.fp8_recipe delayed: "
                                          r"megatron-core does not run first / last layers in bf16 under delayed"):
        TrainingSpec(global_batch_size=8, fp8="hybrid", fp8_bf16_layers_at_end=1)
