"""Tracing real megatron-core GPT models on CPU: shapes, collectives, FLOPs, stages, attribution."""

from collections import Counter

import pytest
import torch

from vtrain_plugin.capture.graph_file import load_graph, save_graph
from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.graph import BlockKind, CollectiveKind, OpGraph, ParallelGroup, Phase
from vtrain_plugin.cost.comm.runtime_collectives import runtime_collectives
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

GPT3 = ModelSpec(name="gpt3-175b", num_layers=96, hidden_size=12288, num_attention_heads=96,
                 seq_length=2048, vocab_size=51200, dtype="fp16")
S, H = 2048, 12288
TP_ALL_REDUCE_BYTES = 2048 * 12288 * 2


@pytest.fixture(scope="module")
def gpt3_tp8():
    return trace(GPT3, ParallelPlan(tensor_parallel=8, pipeline_parallel=16, data_parallel=4))


@pytest.fixture(scope="module")
def gpt3_tp8_recompute():
    return trace(GPT3, ParallelPlan(tensor_parallel=8, pipeline_parallel=16, data_parallel=4, recompute="full"))


@pytest.fixture(scope="module")
def gpt3_tp8_sp():
    return trace(GPT3, ParallelPlan(tensor_parallel=8, pipeline_parallel=16, sequence_parallel=True))


def mm_shapes(layer, phase):
    return Counter(op.key.input_shapes for op in layer.ops(phase) if op.op == "aten.mm.default")


def test_layer_forward_gemms_are_exactly_the_megatron_shards(gpt3_tp8):
    layer = gpt3_tp8.stages[3].layer_template()
    assert mm_shapes(layer, Phase.FORWARD) == Counter({
        ((2048, 12288), (12288, 4608)): 1,  # QKV
        ((2048, 1536), (1536, 12288)): 1,  # attention projection
        ((2048, 12288), (12288, 6144)): 1,  # fc1
        ((2048, 6144), (6144, 12288)): 1,  # fc2
    })
    batched = Counter((op.op, op.key.input_shapes) for op in layer.ops(Phase.FORWARD)
                      if op.op in ("aten.baddbmm.default", "aten.bmm.default"))
    assert batched == Counter({
        ("aten.baddbmm.default", ((12, 2048, 2048), (12, 2048, 128), (12, 128, 2048))): 1,  # Q K^T
        ("aten.bmm.default", ((12, 2048, 2048), (12, 2048, 128))): 1,  # softmax(QK^T) V
    })


def test_layer_backward_has_data_and_weight_gradient_gemms(gpt3_tp8):
    layer = gpt3_tp8.stages[3].layer_template()
    assert mm_shapes(layer, Phase.BACKWARD) == Counter({
        ((2048, 4608), (4608, 12288)): 1, ((4608, 2048), (2048, 12288)): 1,  # QKV dgrad, wgrad
        ((2048, 12288), (12288, 1536)): 1, ((12288, 2048), (2048, 1536)): 1,  # proj
        ((2048, 6144), (6144, 12288)): 1, ((6144, 2048), (2048, 12288)): 1,  # fc1
        ((2048, 12288), (12288, 6144)): 1, ((12288, 2048), (2048, 6144)): 1,  # fc2
    })
    assert sum(1 for op in layer.ops(Phase.BACKWARD) if op.op == "aten.bmm.default") == 4


def test_tensor_parallel_all_reduces_without_sequence_parallel(gpt3_tp8):
    layer = gpt3_tp8.stages[3].layer_template()
    tp = [(c.phase, c.kind, c.nbytes, c.group_size) for c in layer.collectives() if c.group is ParallelGroup.TP]
    assert Counter(tp) == Counter({
        (Phase.FORWARD, CollectiveKind.ALL_REDUCE, TP_ALL_REDUCE_BYTES, 8): 2,
        (Phase.BACKWARD, CollectiveKind.ALL_REDUCE, TP_ALL_REDUCE_BYTES, 8): 2,
    })


def test_sequence_parallel_turns_all_reduces_into_all_gather_and_reduce_scatter(gpt3_tp8_sp):
    layer = gpt3_tp8_sp.stages[3].layer_template()
    tp = Counter((c.phase, c.kind, c.nbytes) for c in layer.collectives() if c.group is ParallelGroup.TP)
    assert tp == Counter({
        (Phase.FORWARD, CollectiveKind.ALL_GATHER, TP_ALL_REDUCE_BYTES): 2,
        (Phase.FORWARD, CollectiveKind.REDUCE_SCATTER, TP_ALL_REDUCE_BYTES): 2,
        # backward: the gathered input is re-gathered for the weight gradient (Megatron does not keep it)
        (Phase.BACKWARD, CollectiveKind.ALL_GATHER, TP_ALL_REDUCE_BYTES): 4,
        (Phase.BACKWARD, CollectiveKind.REDUCE_SCATTER, TP_ALL_REDUCE_BYTES): 2,
    })
    assert gpt3_tp8_sp.stages[1].activation_shape == (2048 // 8, 1, 12288)


def megatron_flops(model: ModelSpec, batch: int, recompute: bool) -> float:
    """Narayanan et al. (2021), eq. 3: per-iteration FLOPs; 3 passes, 4 with full recompute."""
    s, h, l, v = model.seq_length, model.hidden_size, model.num_layers, model.vocab_size
    passes = 4 if recompute else 3
    return passes * 24 * batch * s * l * h * h * (1 + s / (6 * h)) + 6 * batch * s * h * v


@pytest.mark.parametrize("fixture,recompute", [("gpt3_tp8", False), ("gpt3_tp8_recompute", True)])
def test_traced_flops_match_megatron_formula(request, fixture, recompute):
    graph: OpGraph = request.getfixturevalue(fixture)
    traced = graph.flops() * 8  # one TP rank's share, times TP
    expected = megatron_flops(GPT3, batch=1, recompute=recompute)
    assert abs(traced - expected) / expected < 0.02


def test_every_stage_is_traced_with_embedding_first_and_loss_last(gpt3_tp8):
    stages = gpt3_tp8.stages
    assert len(stages) == 16
    assert sum(s.num_layers for s in stages) == 96
    assert stages[0].has_embedding and not stages[0].has_head
    assert stages[-1].has_head and not stages[-1].has_embedding
    assert not any(s.has_embedding or s.has_head for s in stages[1:-1])
    head = next(b for b in stages[-1].blocks if b.kind is BlockKind.HEAD)
    modules = {op.module for op in head.ops()}
    assert "output_layer" in modules
    # vocab-parallel cross-entropy: a max and a sum all-reduced over the TP group
    assert any(c.group is ParallelGroup.TP and c.phase is Phase.FORWARD for c in head.collectives())
    assert any(op.op == "aten.max.dim" for op in head.ops(Phase.FORWARD))


def test_no_kernel_op_is_left_without_a_module(gpt3_tp8_recompute):
    for stage in gpt3_tp8_recompute.stages:
        for block in stage.blocks:
            for op in block.ops():
                if op.phase in (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE):
                    assert op.module, f"{op.op} in {op.phase} has no module"


def test_full_recompute_reruns_each_layer_forward_in_backward(gpt3_tp8, gpt3_tp8_recompute):
    plain = gpt3_tp8.stages[3].layer_template()
    recomputed = gpt3_tp8_recompute.stages[3].layer_template()
    assert not list(plain.ops(Phase.RECOMPUTE))
    forward = [op.key for op in recomputed.ops(Phase.FORWARD)]
    assert [op.key for op in recomputed.ops(Phase.RECOMPUTE)] == forward
    # recompute sits between the forward and the backward of the layer
    phases = [n.phase for n in recomputed.nodes if getattr(n, "launches_kernel", True)]
    first_recompute = phases.index(Phase.RECOMPUTE)
    assert Phase.BACKWARD not in phases[:first_recompute]


def test_selective_recompute_reruns_core_attention_only():
    llama = ModelSpec(family="llama", num_layers=4, hidden_size=1024, num_attention_heads=16,
                      num_query_groups=4, seq_length=512, vocab_size=32000, dtype="bf16")
    graph = trace(llama, ParallelPlan(tensor_parallel=2, recompute="selective"))
    layer = graph.stages[0].layer_template()
    modules = {op.module for op in layer.ops(Phase.RECOMPUTE)}
    assert modules and all(".core_attention" in m for m in modules)


def test_layers_fold_into_one_verified_template_with_the_chunk_count():
    model = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1000)
    plan = ParallelPlan(tensor_parallel=2, pipeline_parallel=2)
    full = trace(model, plan, traced_layers=None)
    short = trace(model, plan, traced_layers=2)
    for a, b in zip(full.stages, short.stages):
        layers = [blk for blk in a.blocks if blk.kind is BlockKind.LAYER]
        assert [blk.count for blk in layers] == [4]
        assert a.flops() == b.flops()
        assert a.num_parameters == b.num_parameters
    assert full.unique_kernels().keys() == short.unique_kernels().keys()


def test_pipeline_and_data_parallel_collectives_are_derived_from_traced_tensors(gpt3_tp8):
    first, middle, last = gpt3_tp8.stages[0], gpt3_tp8.stages[5], gpt3_tp8.stages[-1]
    activation = 2048 * 1 * 12288 * 2

    def runtime(stage):
        return runtime_collectives(stage, gpt3_tp8.parallel, dtype=GPT3.dtype, tied_embeddings=GPT3.tied)

    def p2p(stage):
        return Counter((c.kind, c.phase, c.nbytes) for c in runtime(stage).p2p)

    assert p2p(first) == Counter({(CollectiveKind.SEND, Phase.FORWARD, activation): 1,
                                  (CollectiveKind.RECV, Phase.BACKWARD, activation): 1})
    assert p2p(middle) == Counter({(CollectiveKind.RECV, Phase.FORWARD, activation): 1,
                                   (CollectiveKind.SEND, Phase.FORWARD, activation): 1,
                                   (CollectiveKind.RECV, Phase.BACKWARD, activation): 1,
                                   (CollectiveKind.SEND, Phase.BACKWARD, activation): 1})
    layer = middle.layer_template()
    assert not any(c.group is ParallelGroup.DP for c in layer.collectives())  # runtime, not traced
    dp = [c for c in runtime(middle).nodes(middle) if c.group is ParallelGroup.DP and c.module == layer.name]
    # sharded: weights, QKV and fc1 biases; replicated: proj and fc2 biases, two LayerNorms
    per_layer_params = 12 * H * H // 8 + (3 * H + 4 * H) // 8 + 2 * H + 2 * 2 * H
    assert layer.num_parameters == per_layer_params
    assert len(dp) == 1 and dp[0].group_size == 4 and dp[0].nbytes == per_layer_params * 2
    tied = [c for s in (first, last) for c in runtime(s).embedding_sync if c.group is ParallelGroup.EMBEDDING]
    assert [c.nbytes for c in tied] == [51200 // 8 * H * 2] * 2


def test_graph_json_round_trip(tmp_path, gpt3_tp8):
    path = tmp_path / "graph.json"
    save_graph(gpt3_tp8, path)
    assert load_graph(path) == gpt3_tp8


def _llama_config(**fields):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, normalization="RMSNorm",
                 gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                 hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=704, bf16=True)
    return TransformerConfig(**{**llama, **fields})


def test_trace_from_a_megatron_transformer_config():
    graph = trace(_llama_config(tensor_model_parallel_size=2), ParallelPlan(tensor_parallel=2),
                  vocab_size=1000, seq_length=64)
    assert graph.model.family is Family.LLAMA and graph.model.dtype is Dtype.BF16
    layer = graph.stages[0].layer_template()
    # QKV of a GQA layer: 8 query heads + 2 x 2 KV heads of 32, split over 2 ranks
    assert ((64, 256), (256, (8 + 2 * 2) * 32 // 2)) in mm_shapes(layer, Phase.FORWARD)
    assert layer.count == 4


def test_a_bare_transformer_config_is_traced_with_its_own_parallel_plan():
    """Regression: trace(config) ignored the config's TP / PP / SP / recompute and traced TP 1, PP 1."""
    config = _llama_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16,
                           sequence_parallel=True,
                           recompute_granularity="selective")
    graph = trace(config, vocab_size=1000, seq_length=64)
    assert graph.parallel == ParallelPlan(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True,
                                          recompute="selective")
    assert len(graph.stages) == 2


def test_a_transformer_configs_uneven_pipeline_split_becomes_the_plans():
    """num_layers_in_first/last_pipeline_stage and account_for_embedding/loss_in_pipeline_split were
    refused; they map onto the plan's uneven-split fields and each chunk gets megatron-core's layers."""
    from vtrain_plugin.core.errors import ConfigError

    first_last = _llama_config(num_layers=6, pipeline_model_parallel_size=3, pipeline_dtype=torch.bfloat16,
                               num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)
    graph = trace(first_last, vocab_size=1000, seq_length=64)
    assert graph.parallel == ParallelPlan(pipeline_parallel=3, decoder_first_pipeline_num_layers=1,
                                          decoder_last_pipeline_num_layers=3)
    assert [s.num_layers for s in graph.stages] == [1, 2, 3]
    accounted = _llama_config(num_layers=6, pipeline_model_parallel_size=4, pipeline_dtype=torch.bfloat16,
                              account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    graph = trace(accounted, vocab_size=1000, seq_length=64)
    assert graph.parallel == ParallelPlan(pipeline_parallel=4, account_for_embedding_in_pipeline_split=True,
                                          account_for_loss_in_pipeline_split=True)
    assert [s.num_layers for s in graph.stages] == [1, 2, 2, 1]
    with pytest.raises(ConfigError, match=r"parallel.decoder_first_pipeline_num_layers \(None\) != "
                                          r"TransformerConfig.num_layers_in_first_pipeline_stage \(1\)"):
        trace(first_last, ParallelPlan(pipeline_parallel=3), vocab_size=1000, seq_length=64)


def test_a_transformer_config_with_context_parallelism_is_traced_on_one_cp_rank():
    graph = trace(_llama_config(context_parallel_size=2, cp_comm_type="all_gather"), vocab_size=1000, seq_length=64)
    assert graph.parallel == ParallelPlan(context_parallel=2, cp_comm_type="all_gather")
    assert graph.seq_length == 64 and graph.stages[0].activation_shape == (32, 1, 256)


@pytest.mark.parametrize("fields, plan, message", [
    (dict(tensor_model_parallel_size=4), ParallelPlan(tensor_parallel=2),
     "parallel.tensor_parallel (2) != TransformerConfig.tensor_model_parallel_size (4)"),
    (dict(context_parallel_size=2, cp_comm_type="ring"), None,
     "TransformerConfig.cp_comm_type='ring': must be one of p2p, all_gather, a2a, a2a+p2p"),
    (dict(context_parallel_size=2), ParallelPlan(context_parallel=4),
     "parallel.context_parallel (4) != TransformerConfig.context_parallel_size (2)"),
    (dict(num_moe_experts=8, moe_latent_size=64), None,
     "TransformerConfig.moe_latent_size=64: MoE latent projections is not modelled"),
    (dict(fp8="hybrid"), None, "TransformerConfig.fp8='hybrid': fp8 training is not modelled"),
    (dict(activation_func=torch.nn.functional.relu), None,
     "TransformerConfig.activation_func=relu: an MLP activation other than gelu, silu (SwiGLU), squared_relu or "
     "quick_gelu"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), None,
     "TransformerConfig.recompute_method='block', recompute_num_layers=2"),
])
def test_transformer_config_fields_vtrain_does_not_model_are_refused(fields, plan, message):
    """Regression: MoE, context-parallel and fp8 fields were ignored without a word (CP is now modelled,
    TE's a2a exchange is not)."""
    from vtrain_plugin.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        trace(_llama_config(**fields), plan, vocab_size=1000, seq_length=64)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_tracing_leaves_the_process_excepthook_alone(monkeypatch):
    """torch's init_process_group prefixes every later traceback with "[rank<r>]:" unless undone."""
    import sys

    from vtrain_plugin.capture.tracer import clear_cache

    before = sys.excepthook
    clear_cache()
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")  # really trace, whatever the session traced before
    trace(ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128),
          ParallelPlan(tensor_parallel=2))
    assert sys.excepthook is before


def test_uneven_split_traces_each_chunk_with_its_own_layers_and_estimates():
    """6 layers + embedding + loss = 8 slots over PP 4 x VP 2: the first virtual stage holds the
    embedding alone and the last the loss alone (Megatron-Core builds them with no layer)."""
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.hardware.clusters import get_cluster_preset
    from vtrain_plugin.specs.training import TrainingSpec

    model = ModelSpec(family="llama", num_layers=6, hidden_size=256, num_attention_heads=4, seq_length=128,
                      vocab_size=1024, dtype="bf16")
    plan = ParallelPlan(pipeline_parallel=4, virtual_pipeline=2, account_for_embedding_in_pipeline_split=True,
                        account_for_loss_in_pipeline_split=True)
    graph = trace(model, plan)
    layers = {(s.pipeline_rank, s.chunk): s.num_layers for s in graph.stages}
    assert layers == {(r, c): 0 if (r, c) in ((0, 0), (3, 1)) else 1 for r in range(4) for c in range(2)}
    first, last = graph.stage(0, 0), graph.stage(3, 1)
    assert first.has_embedding and not first.has_head and first.layer_template() is None
    assert last.has_head and not last.has_embedding and last.layer_template() is None
    per_layer = graph.stage(1, 0).num_parameters
    assert graph.stage(0, 1).num_parameters == per_layer
    est = estimate(graph, cluster=get_cluster_preset("dgx-h100"),
                   training=TrainingSpec(global_batch_size=8, schedule="interleaved_1f1b"))
    assert len(est.stage_breakdown_ms) == 4 and est.iteration_time_ms > 0
    for rank, memory in enumerate(est.memory_gib):  # 2 bytes per bf16 weight of the rank's two chunks
        params = graph.stage(rank, 0).num_parameters + graph.stage(rank, 1).num_parameters
        assert memory.weights_gib * 2**30 == 2 * params
