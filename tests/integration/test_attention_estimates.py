"""Multi-latent attention, sliding windows, attention sinks, NoPE layers, multi-token prediction and
pipeline layouts: traced from megatron-core's own layers, lowered to TransformerEngine's kernels, estimated,
and read alike from a ModelSpec, a megatron-core config, Megatron-LM arguments and a plan file."""

import json
from dataclasses import replace

import pytest
import torch

import vtrain_plugin as vtrain
from megatron_adapters.stand_ins import sliding_window_causal_mask
from vtrain_plugin.capture.folding import is_windowed
from vtrain_plugin.core.graph import BlockKind, OpNode, Phase
from vtrain_plugin.cost.lowering.megatron_core_te import megatron_core_te
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import resolve_cluster
from vtrain_plugin.runs import run_config_from_dict, run_config_from_megatron_args
from vtrain_plugin.specs.attention import mla_parameters
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

H, N, S, VOCAB, FFN = 64, 4, 32, 256, 128
D = H // N
Q_LORA, KV_LORA, QK, ROPE, VD = 32, 16, 8, 4, 16  # every MLA dim different, so each shape names its tensor
DK = QK + ROPE
WINDOW = 8
MLA = dict(multi_latent_attention=True, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=QK,
           qk_pos_emb_head_dim=ROPE, v_head_dim=VD)
BF16 = 2
CLUSTER = resolve_cluster({"preset": "dgx-h100"})


def spec(layers: int = 4, **fields) -> ModelSpec:
    dims = dict(family="llama", num_layers=layers, hidden_size=H, num_attention_heads=N, seq_length=S,
                vocab_size=VOCAB, ffn_hidden_size=FFN, dtype="bf16")
    return ModelSpec(**{**dims, **fields})


def layers(stage):
    return [b for b in stage.blocks if b.kind is BlockKind.LAYER]


def fused(block, op: str) -> OpNode:
    (node,) = [n for n in megatron_core_te(block.nodes) if isinstance(n, OpNode) and n.key.op == op]
    return node


FWD, BWD = "te.fused_attention.default", "te.fused_attention_backward.default"


def total_parameters(graph) -> int:
    return sum(b.num_parameters * b.count for stage in graph.stages for b in stage.blocks)


# ------------------------------------------------------------------------------------------------
# Multi-latent attention
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mla_graph():
    return vtrain.trace(spec(**MLA), ParallelPlan())


def test_mla_layers_are_megatron_cores_own_with_the_mla_parameters(mla_graph):
    (layer,) = layers(mla_graph.stages[0])
    assert layer.count == 4
    norms, mlp = 2 * H, 3 * H * FFN  # input and pre-MLP RMSNorm; SwiGLU fc1 (2 FFN x H) and fc2
    assert mla_parameters(spec(**MLA)) == 10_544  # the formula of tests/integration/standins/test_mla.py
    assert layer.num_parameters == 10_544 + norms + mlp
    assert total_parameters(mla_graph) == spec(**MLA).num_parameters


def test_mla_core_attention_lowers_to_one_fused_kernel_over_both_head_dims(mla_graph):
    (layer,) = layers(mla_graph.stages[0])
    forward, backward = fused(layer, FWD), fused(layer, BWD)
    assert forward.key.input_shapes == ((S, 1, N, DK), (S, 1, N, DK), (S, 1, N, VD))
    assert forward.output_shapes == ((S, 1, N, VD),)
    # scores over DK and context over VD on the causal half of S x S, 2 FLOPs per multiply-add
    assert forward.flops == 2 * N * (S * S // 2) * (DK + VD) == 114_688
    assert backward.flops == 2.5 * forward.flops
    per_side = S * N * (DK + VD)  # Q and O; K and V (one key/value per head)
    assert forward.nbytes == BF16 * 2 * per_side + 4 * N * S
    assert backward.nbytes == BF16 * 4 * per_side + 4 * N * S


def test_mla_moves_the_gemms_by_its_projections(mla_graph):
    """MLA against multi-head attention of the same heads: the layer's forward GEMMs (2 FLOPs per
    weight and token) follow the projections' weights exactly."""
    mha = vtrain.trace(spec(), ParallelPlan())

    def gemm_flops(graph):
        (layer,) = layers(graph.stages[0])
        return sum(n.flops for n in layer.nodes if isinstance(n, OpNode) and n.phase is Phase.FORWARD
                   and n.key.op == "aten.mm.default")

    mla_weights = mla_parameters(spec(**MLA)) - Q_LORA - KV_LORA  # less the latent norms
    assert gemm_flops(mla_graph) - gemm_flops(mha) == 2 * S * (mla_weights - 4 * H * H)
    mla_est = estimate(mla_graph, cluster=CLUSTER, global_batch_size=8)
    mha_est = estimate(mha, cluster=CLUSTER, global_batch_size=8)
    assert mla_weights < 4 * H * H  # this MLA is the smaller: fewer weights, less weight memory
    assert mla_est.memory_gib[0].weights_gib < mha_est.memory_gib[0].weights_gib


# ------------------------------------------------------------------------------------------------
# Sliding windows, alternating with full attention
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def windowed_graph():
    # 6 layers over 2 stages: layers 1-3 and 4-6; window_attn_skip_freq 2: every even layer is full
    return vtrain.trace(spec(6, window_size=(WINDOW, 0), window_attn_skip_freq=2),
                        ParallelPlan(pipeline_parallel=2))


def test_each_stage_counts_its_windowed_and_full_layers(windowed_graph):
    counts = [{is_windowed(b): b.count for b in layers(stage)} for stage in windowed_graph.stages]
    assert counts == [{True: 2, False: 1}, {True: 1, False: 2}]  # windows on layers 1, 3 | 5
    assert total_parameters(windowed_graph) == spec(6).num_parameters


def test_a_windowed_kernel_computes_exactly_the_in_window_scores(windowed_graph):
    stage = windowed_graph.stages[0]
    windowed = next(b for b in layers(stage) if is_windowed(b))
    full = next(b for b in layers(stage) if not is_windowed(b))
    in_window = int((~sliding_window_causal_mask(S, S, (WINDOW, 0))).sum())  # the mask megatron-core applies
    assert in_window == (WINDOW + 1) * S - WINDOW * (WINDOW + 1) // 2 == 252
    assert fused(windowed, FWD).flops == 2 * N * in_window * 2 * D
    assert fused(windowed, BWD).flops == 2.5 * 2 * N * in_window * 2 * D
    assert fused(full, FWD).flops == 2 * N * (S * S // 2) * 2 * D
    assert fused(windowed, FWD).nbytes == fused(full, FWD).nbytes  # the same Q, K, V read, O written


def test_a_window_shortens_attention_at_long_sequences():
    long = dict(hidden_size=4096, num_attention_heads=32, seq_length=16384, ffn_hidden_size=8192)
    full = estimate(vtrain.trace(spec(2, **long), ParallelPlan()), cluster=CLUSTER, global_batch_size=8)
    window = estimate(vtrain.trace(spec(2, **long, window_size=(127, 0)), ParallelPlan()), cluster=CLUSTER,
                      global_batch_size=8)
    alternating = estimate(vtrain.trace(spec(2, **long, window_size=(127, 0), window_attn_skip_freq=2),
                                        ParallelPlan()), cluster=CLUSTER, global_batch_size=8)
    for phase in ("forward", "backward"):
        assert window.breakdown_ms[phase] < alternating.breakdown_ms[phase] < full.breakdown_ms[phase]
    assert window.iteration_time_ms < alternating.iteration_time_ms < full.iteration_time_ms


# ------------------------------------------------------------------------------------------------
# Attention sinks
# ------------------------------------------------------------------------------------------------


def test_sinks_add_one_learned_logit_per_head_and_no_gemm_work():
    vanilla = vtrain.trace(spec(), ParallelPlan())
    sinks = vtrain.trace(spec(softmax_type="learnable"), ParallelPlan())
    (plain_layer,), (sink_layer,) = layers(vanilla.stages[0]), layers(sinks.stages[0])
    assert sink_layer.num_parameters == plain_layer.num_parameters + N
    assert total_parameters(sinks) == spec(softmax_type="learnable").num_parameters
    assert fused(sink_layer, FWD).flops == fused(plain_layer, FWD).flops
    assert fused(sink_layer, FWD).nbytes == fused(plain_layer, FWD).nbytes + BF16 * N
    assert fused(sink_layer, BWD).nbytes == fused(plain_layer, BWD).nbytes + 2 * BF16 * N
    plain_est = estimate(vanilla, cluster=CLUSTER, global_batch_size=8)
    sink_est = estimate(sinks, cluster=CLUSTER, global_batch_size=8)
    assert sink_est.memory_gib[0].weights_gib > plain_est.memory_gib[0].weights_gib
    assert sink_est.iteration_time_ms >= plain_est.iteration_time_ms


# ------------------------------------------------------------------------------------------------
# NoPE layers (Llama 4's no_rope_freq)
# ------------------------------------------------------------------------------------------------

ROPE_FWD = "te.fused_rope.default"


def rope_kernels(block) -> int:
    return sum(1 for n in megatron_core_te(block.nodes) if isinstance(n, OpNode) and n.key.op == ROPE_FWD)


def test_nope_layers_run_no_rotary_kernel_and_each_stage_counts_its_own():
    # 8 layers over 2 stages (layers 1-4 | 5-8); no_rope_freq 4: layers 4 and 8 skip RoPE
    graph = vtrain.trace(spec(8, no_rope_freq=4), ParallelPlan(pipeline_parallel=2))
    for stage in graph.stages:
        # per layer: queries and keys rotated in one fused kernel each, or neither
        assert {rope_kernels(b): b.count for b in layers(stage)} == {2: 3, 0: 1}
    assert total_parameters(graph) == spec(8).num_parameters  # NoPE has no weights of its own
    every = vtrain.trace(spec(4, no_rope_freq=1), ParallelPlan())
    assert [(rope_kernels(b), b.count) for b in layers(every.stages[0])] == [(0, 4)]


def test_nope_layers_shorten_the_estimate():
    """Ablation: each NoPE layer drops the rotary kernels of queries and keys, forward and backward."""
    def est(**fields):
        return estimate(vtrain.trace(spec(4, seq_length=4096, **fields), ParallelPlan()), cluster=CLUSTER,
                        global_batch_size=8)

    rope, quarter, every = est(), est(no_rope_freq=4), est(no_rope_freq=1)
    for phase in ("forward", "backward"):
        assert every.breakdown_ms[phase] < quarter.breakdown_ms[phase] < rope.breakdown_ms[phase]
    assert every.iteration_time_ms < quarter.iteration_time_ms < rope.iteration_time_ms


# ------------------------------------------------------------------------------------------------
# One answer on every input path
# ------------------------------------------------------------------------------------------------

FLAGS = (f"--num-layers 4 --hidden-size {H} --num-attention-heads {N} --seq-length {S} --ffn-hidden-size {FFN} "
         f"--vocab-size {VOCAB} --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 8 --bf16 "
         f"--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         f"--hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights")
MLA_FLAGS = (f"--multi-latent-attention --qk-layernorm --q-lora-rank {Q_LORA} --kv-lora-rank {KV_LORA} "
             f"--qk-head-dim {QK} --qk-pos-emb-head-dim {ROPE} --v-head-dim {VD} --rotary-scaling-factor 40 "
             f"--mscale 1.0 --mscale-all-dim 1.0 --kv-channels 128")
WINDOW_FLAGS = f"--window-size {WINDOW},0 --window-attn-skip-freq 2 --softmax-type learnable"
WINDOW_FIELDS = dict(window_size=(WINDOW, 0), window_attn_skip_freq=2, softmax_type="learnable")


def config(mla: bool, **fields):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    common = dict(num_layers=4, hidden_size=H, num_attention_heads=N, ffn_hidden_size=FFN, normalization="RMSNorm",
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    if mla:
        return MLATransformerConfig(**common, qk_layernorm=True, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
                                    qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=VD, rotary_scaling_factor=40)
    return TransformerConfig(**common, **fields)


def plan_file(**fields) -> dict:
    model = dict(family="llama", num_layers=4, hidden_size=H, num_attention_heads=N, seq_length=S,
                 vocab_size=VOCAB + 1, ffn_hidden_size=FFN, dtype="bf16", tied_embeddings=False, **fields)
    return {"model": model, "parallel": {}, "training": {"global_batch_size": 8}, "cluster": {"preset": "dgx-h100"}}


@pytest.mark.parametrize("flags, mla, fields", [
    (MLA_FLAGS, True, MLA),
    (WINDOW_FLAGS, False, WINDOW_FIELDS),
    ("--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1", False, dict(mtp_num_layers=1)),
    ("--no-rope-freq 2", False, dict(no_rope_freq=2)),
], ids=["mla", "window-and-sinks", "mtp", "nope"])
def test_every_input_path_gives_the_same_model_and_estimate(flags, mla, fields):
    from_args = run_config_from_megatron_args(f"{FLAGS} {flags}", gpus=1, cluster=CLUSTER)
    from_plan = run_config_from_dict(plan_file(**{k: list(v) if isinstance(v, tuple) else v
                                                  for k, v in fields.items()}))
    cfg = config(mla, **({} if mla else fields))
    traced = vtrain.trace(cfg, ParallelPlan(), vocab_size=VOCAB + 1, seq_length=S)  # NullTokenizer adds one
    models = [replace(m, num_query_groups=m.query_groups, tied_embeddings=m.tied)  # each path's spelling of one
              for m in (from_args.model, from_plan.model, traced.model)]  # default: None or the value it means
    assert models[0] == models[1] == models[2]
    assert {k: getattr(traced.model, k) for k in fields} == fields
    estimates = [estimate(from_args), estimate(from_plan),
                 estimate(traced, cluster=CLUSTER, training=from_plan.training)]
    assert len({(e.iteration_time_ms, e.peak_memory_gib) for e in estimates}) == 1


def test_the_cli_estimates_mla_from_arguments_as_from_a_plan_file(tmp_path, run_cli):
    plan = tmp_path / "mla.json"
    plan.write_text(json.dumps(plan_file(**MLA)))
    from_file = json.loads(run_cli("estimate", str(plan), "--format", "json", check=True).stdout)
    from_args = json.loads(run_cli("estimate", "--megatron-args", f"{FLAGS} {MLA_FLAGS}", "--gpus", "1",
                                   "--gpu", "H100", "--format", "json", check=True).stdout)
    assert from_args["iteration_time_ms"] == from_file["iteration_time_ms"] > 0
    assert from_args["memory_gib_per_stage"] == from_file["memory_gib_per_stage"]
    mha = estimate(run_config_from_dict(plan_file()))  # the same heads without MLA: another estimate
    assert mha.peak_memory_gib != pytest.approx(from_file["peak_memory_gib"], rel=1e-9)


# ------------------------------------------------------------------------------------------------
# Pipeline layouts (DeepSeek-V3 / Kimi K2 publish 61 layers over PP x VP stages)
# ------------------------------------------------------------------------------------------------

LAYOUT = "Et|tt|t|L"  # PP 2 x VP 2: virtual stages (chunk 0: ranks 0, 1; chunk 1: ranks 0, 1), the last the loss alone


def test_a_layout_reads_alike_on_every_path_and_places_the_layers():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adapters.config_map import parallel_plan_from_transformer_config

    flags = FLAGS.replace("--global-batch-size 8", "--global-batch-size 4")
    from_args = run_config_from_megatron_args(
        f"{flags} --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '{LAYOUT}'", gpus=2, cluster=CLUSTER)
    from_plan = run_config_from_dict({**plan_file(), "parallel": {"pipeline_parallel": 2, "virtual_pipeline": 2,
                                                                  "pipeline_layout": LAYOUT},
                                      "training": {"global_batch_size": 4, "schedule": "interleaved_1f1b"}})
    cfg = TransformerConfig(num_layers=4, hidden_size=H, num_attention_heads=N, pipeline_model_parallel_size=2,
                            pipeline_dtype=torch.bfloat16, pipeline_model_parallel_layout=LAYOUT)
    from_config = parallel_plan_from_transformer_config(cfg, None)
    assert from_args.parallel == from_plan.parallel == from_config
    assert from_config.virtual_pipeline == 2 and from_config.pipeline_layout == LAYOUT
    assert from_plan.parallel.chunk_layers(from_plan.model) == ((1, 1), (2, 0))
    graph = vtrain.trace(from_plan.model, from_plan.parallel)
    laid_out = {(s.pipeline_rank, s.chunk): sum(b.count for b in layers(s)) for s in graph.stages}
    assert laid_out == {(0, 0): 1, (1, 0): 2, (0, 1): 1, (1, 1): 0}
    assert estimate(from_args).iteration_time_ms == estimate(from_plan).iteration_time_ms > 0



# ------------------------------------------------------------------------------------------------
# Multi-token prediction, on the last stage
# ------------------------------------------------------------------------------------------------


def test_mtp_layers_are_traced_in_the_head_of_the_last_stage():
    model = spec(mtp_num_layers=1)
    graph = vtrain.trace(model, ParallelPlan(pipeline_parallel=2))
    first, last = graph.stages
    assert [(b.name, b.count) for b in layers(first)] == [(b.name, b.count) for b in layers(last)] == \
        [("decoder.layers.0", 2)]
    assert not any("mtp." in n.module for b in first.blocks for n in b.nodes)
    (head,) = [b for b in last.blocks if b.kind is BlockKind.HEAD]
    projection = [n for n in head.nodes if isinstance(n, OpNode) and n.phase is Phase.FORWARD
                  and n.module == "mtp.layers.0.eh_proj" and n.key.op == "aten.mm.default"]
    assert [n.key.input_shapes for n in projection] == [((S, 2 * H), (2 * H, H))]  # [embedding; hidden] -> hidden
    # the MTP layer's attention is TE's fused kernel too
    assert fused(head, FWD).module == "mtp.layers.0.transformer_layer.self_attention.core_attention"
    # one stage: the traced parameters are the model's (with PP the last stage holds an embedding copy too)
    assert total_parameters(vtrain.trace(model, ParallelPlan())) == model.num_parameters
    # under sequence parallelism (DeepSeek-V3's TP 2 + SP): MTP's norms are torch's, as the layers'
    sp = vtrain.trace(model, ParallelPlan(tensor_parallel=2, sequence_parallel=True))
    assert any(n.module == "mtp.layers.0.eh_proj" for b in sp.stages[0].blocks for n in b.nodes)


def test_mtp_adds_time_and_memory_on_the_last_stage_only():
    plan = ParallelPlan(pipeline_parallel=2)
    plain = estimate(vtrain.trace(spec(), plan), cluster=CLUSTER, global_batch_size=8)
    mtp = estimate(vtrain.trace(spec(mtp_num_layers=1), plan), cluster=CLUSTER, global_batch_size=8)
    assert mtp.iteration_time_ms > plain.iteration_time_ms
    assert mtp.memory_gib[0] == plain.memory_gib[0]
    assert mtp.memory_gib[1].weights_gib > plain.memory_gib[1].weights_gib
    assert mtp.memory_gib[1].activations_gib > plain.memory_gib[1].activations_gib
