"""CUDA graphs on a small real megatron-core Llama traced on the fake process group: the host-bound
model gets faster, the graphs' static buffers join the memory, and Megatron-LM's flags map to them."""

from __future__ import annotations

import math

import pytest

from vtrain_plugin import estimate
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import BlockKind
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.memory import all_held
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.runs import run_config_from_megatron_args
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

MODEL = ModelSpec(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                  vocab_size=256, dtype="bf16")
H100 = cluster_for_gpu("h100")


@pytest.fixture(scope="module")
def graph():
    from vtrain_plugin.capture.tracer import trace

    return trace(MODEL, ParallelPlan(micro_batch_size=2))


def _estimate(graph, **graphs):
    return estimate(graph, cluster=H100, training=TrainingSpec(global_batch_size=4, **graphs), profile_db=False)


def test_graphs_speed_up_the_host_bound_model_and_keep_static_buffers(graph):
    eager = _estimate(graph)
    layers = _estimate(graph, cuda_graph_impl="transformer_engine")
    attention = _estimate(graph, cuda_graph_impl="transformer_engine", cuda_graph_scope=("attn",))
    whole = _estimate(graph, cuda_graph_impl="local", cuda_graph_scope=("full_iteration",))
    assert whole.iteration_time_ms < layers.iteration_time_ms < attention.iteration_time_ms < eager.iteration_time_ms
    stage = graph.stages[0]
    activation = math.prod(stage.activation_shape)
    pool = sum(b.count * (2 * activation + b.num_parameters) * 2 for b in stage.blocks if b.kind is BlockKind.LAYER)
    assert layers.memory_gib[0].allowance_gib - eager.memory_gib[0].allowance_gib == pytest.approx(pool / GIB)
    assert layers.memory_gib[0].tensors_gib == eager.memory_gib[0].tensors_gib


def test_megatron_flags_map_to_the_graph_settings():
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 1 --vocab-size 256 --bf16").split()

    def training(*flags):
        return run_config_from_megatron_args([*base, *flags], gpus=1).training

    t = training("--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn,mlp",
                 "--cuda-graph-warmup-steps", "5")
    assert (t.cuda_graph_impl, t.cuda_graph_scope) == ("transformer_engine", ("attn", "mlp"))
    assert (t.cuda_graph_warmup_steps, training().cuda_graph_warmup_steps) == (5, 3)  # Megatron-LM's default: 3
    with pytest.raises(ConfigError, match=r"^training.cuda_graph_warmup_steps must be a non-negative integer"):
        TrainingSpec(global_batch_size=4, cuda_graph_warmup_steps=-1)
    assert training("--enable-cuda-graph").cuda_graph_impl == "local"
    assert training("--external-cuda-graph").cuda_graph_impl == "transformer_engine"
    assert training("--cuda-graph-impl", "local", "--cuda-graph-scope", "full").cuda_graph_scope == ()
    with pytest.raises(ConfigError, match=r"^training.cuda_graph_scope must be one of full_iteration, attn, "):
        training("--cuda-graph-impl", "local", "--cuda-graph-scope", "layers")
    with pytest.raises(ConfigError, match=r"^training.cuda_graph_scope full_iteration needs training.cuda_graph_impl "
                                          r"local"):
        training("--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "full_iteration")


def test_graphs_captured_before_any_eager_step_hold_their_saves_only_while_captured(graph):
    """TransformerEngine's graphs captured before any eager iteration (--cuda-graph-warmup-steps 0):
    the captured attention's saves live in the graphs' pool, outside ``max allocated`` as they replay;
    they count while captured, in the schedule's order with nothing else of the step. The peak is the
    larger walk: captured saves with the unfused attention's backward, or the rest with the step's."""
    from vtrain_plugin.cost.cuda_graphs import captured_saved_nbytes
    from vtrain_plugin.cost.lowering.megatron_core_te import unfused_backward_score_nbytes
    from vtrain_plugin.cost.stack_memory import stack_rank_memory
    from vtrain_plugin.specs.training import SoftwareStack

    walked = []  # the stash of each walk

    def memory(**graphs):
        def peak_live(rank, chunks, rises):
            walked.append(sum(chunks))
            return all_held(rank, chunks, rises)

        training = TrainingSpec(global_batch_size=4, unfused_attention=True, **graphs)
        (rank,) = stack_rank_memory(graph, peak_live, SoftwareStack.MEGATRON_CORE_TE, training)
        return training, rank

    _, eager = memory()
    stash = walked[0]
    _, warmed = memory(cuda_graph_impl="transformer_engine", cuda_graph_scope=("attn",))
    training, captured_first = memory(cuda_graph_impl="transformer_engine", cuda_graph_scope=("attn",),
                                      cuda_graph_warmup_steps=0)
    assert warmed.activations_gib == eager.activations_gib  # the eager warm-up steps reach the eager peak
    layer = graph.stages[0].layer_template()
    heads, s, b = MODEL.num_attention_heads, MODEL.seq_length, 2
    captured = captured_saved_nbytes(layer, training, te=True)
    assert captured >= heads * s * s * b * 2  # the bf16 probabilities the unfused attention saves
    stage = graph.stages[0]
    capture = layer.count * captured + unfused_backward_score_nbytes(layer.nodes)
    replay = stash - layer.count * captured + stage.held_outside_attention_nbytes \
        + stage.backward_peak_outside_attention_nbytes
    assert captured_first.activations_gib * GIB == pytest.approx(max(capture, replay), abs=1)
    assert captured_first.activations_gib < eager.activations_gib
