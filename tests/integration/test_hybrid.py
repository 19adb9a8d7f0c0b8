"""Mamba hybrids (megatron-core MambaModel) end to end: traced per stage with one layer of each kind,
the mixer lowered to mamba_ssm's kernels, parameters as megatron-core counts them, the estimate's
direction under ablations, and one estimate from every input path."""

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_adapters.cpu_patches import cpu_tracing_patches
from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
from vtrain_plugin import estimate, trace
from vtrain_plugin.core.graph import BlockKind, OpNode, Phase
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify
from vtrain_plugin.cost.lowering.fusion import op_name
from vtrain_plugin.cost.lowering.mamba import MixerDims, mixer_dims, mixer_saved_delta
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.cli.render import layer_kinds
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

H, HEADS, SEQ, VOCAB = 256, 4, 256, 1024
STATE, HEADDIM, GROUPS = 16, 32, 2
D_INNER, MAMBA_HEADS = 2 * H, 2 * H // HEADDIM  # 512, 16
PATTERN = "M*-M-M"
MODEL = ModelSpec(family="gpt", num_layers=len(PATTERN), hidden_size=H, num_attention_heads=HEADS, seq_length=SEQ,
                  vocab_size=VOCAB, dtype="bf16", hybrid_layer_pattern=PATTERN, mamba_state_dim=STATE,
                  mamba_head_dim=HEADDIM, mamba_num_groups=GROUPS)
TP = 2
PLAN = ParallelPlan(tensor_parallel=TP, sequence_parallel=True, pipeline_parallel=2)
MIXER_FORWARD = ["causal_conv1d_fwd", "chunk_cumsum_fwd", "chunk_state_fwd", "state_passing_fwd", "bmm_chunk_fwd",
                 "chunk_scan_fwd", "gated_rms_norm_fwd"]
MIXER_BACKWARD = ["causal_conv1d_fwd", "gated_rms_norm_bwd", "chunk_cumsum_fwd", "chunk_state_fwd",
                  "state_passing_fwd", "bmm_chunk_fwd", "chunk_scan_bwd_dstates", "state_passing_bwd",
                  "chunk_scan_chunk_state_bwd_dx", "chunk_scan_bwd_dC", "chunk_state_bwd_db", "chunk_scan_bwd_dcb",
                  "bmm_chunk_bwd", "chunk_scan_bwd_ddAcs", "chunk_cumsum_bwd", "causal_conv1d_bwd"]


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, PLAN)


def megatron_core_shards(model: ModelSpec, plan: ParallelPlan) -> list[int]:
    """Parameters of each pipeline rank's shard of the whole MambaModel, as megatron-core builds it
    (every layer of the pattern, MambaStack selecting the rank's slice)."""
    from megatron.core.models.mamba import MambaModel

    from megatron_adapters.gpt import _cast_parameters, transformer_config
    from megatron_adapters.hybrid import _POSITION_EMBEDDING
    from megatron_adapters.stand_ins import hybrid_stack_spec

    counts = []
    for rank in range(plan.pipeline_parallel):
        with quiet_megatron(), cpu_tracing_patches(), fake_world(plan, pipeline_rank=rank):
            reset_global_memory_buffer()
            with FakeTensorMode(allow_non_fake_inputs=True):
                config = transformer_config(model, plan, layers_per_chunk=model.num_layers // plan.pipeline_parallel)
                mamba = MambaModel(config, hybrid_stack_spec(num_experts=model.num_experts), vocab_size=model.padded_vocab_size(plan.tensor_parallel),
                                   max_sequence_length=model.seq_length, pre_process=rank == 0,
                                   post_process=rank == plan.pipeline_parallel - 1,
                                   hybrid_override_pattern=model.hybrid_layer_pattern,
                                   share_embeddings_and_output_weights=model.tied,
                                   position_embedding_type=_POSITION_EMBEDDING[model.family])
                _cast_parameters(mamba, torch.bfloat16)
                counts.append(sum(p.numel() for p in mamba.parameters()))
            reset_global_memory_buffer()
    return counts


def test_each_stage_counts_its_slice_of_the_pattern_on_one_traced_layer_per_kind(graph):
    # MambaStack gives rank 0 "M*-" and rank 1 "M-M": the traced layers 0, 1, 2 are M, *, -. Rank 0's
    # stack runs nothing outside its layers (it only asked its input's device, which launches nothing
    # and is not recorded), so it has no stage block.
    assert [[(b.kind, b.name, b.count) for b in s.blocks] for s in graph.stages] == [
        [(BlockKind.EMBEDDING, "embedding", 1),
         (BlockKind.LAYER, "decoder.layers.0", 1), (BlockKind.LAYER, "decoder.layers.1", 1),
         (BlockKind.LAYER, "decoder.layers.2", 1)],
        [(BlockKind.STAGE, "stage", 1), (BlockKind.LAYER, "decoder.layers.0", 2),
         (BlockKind.LAYER, "decoder.layers.2", 1), (BlockKind.HEAD, "head", 1)]]
    first = {b.name: b for b in graph.stages[0].blocks}

    def forward_ops(block):
        return Counter(op_name(n) for n in block.ops(Phase.FORWARD))

    mamba, attention, mlp = (first[f"decoder.layers.{i}"] for i in range(3))
    assert forward_ops(mamba)["convolution"] == 1 and forward_ops(mamba)["bmm"] == 5
    assert forward_ops(attention)["baddbmm"] == 1 and forward_ops(attention)["convolution"] == 0
    assert forward_ops(mlp)["mm"] == 2 and forward_ops(mlp)["bmm"] == 0
    in_proj = 2 * D_INNER + 2 * GROUPS * STATE + MAMBA_HEADS
    conv = D_INNER + 2 * GROUPS * STATE
    # LayerNorm (weight, bias) whole on each rank; the mixer split over TP by heads and groups
    assert mamba.num_parameters == 2 * H + (H * in_proj + conv * 5 + 3 * MAMBA_HEADS + D_INNER + D_INNER * H) // TP


def test_stage_parameters_are_megatron_cores_shards_and_the_spec_counts_the_whole_model(graph):
    traced = [sum(b.count * b.num_parameters for b in s.blocks) for s in graph.stages]
    assert traced == megatron_core_shards(MODEL, PLAN)
    assert MODEL.num_parameters == sum(megatron_core_shards(MODEL, ParallelPlan()))


def test_a_nemotron_h_56b_shaped_spec_counts_its_parameters_as_megatron_core():
    pattern = "M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-"
    model = ModelSpec(family="llama", num_layers=len(pattern), hidden_size=8192, num_attention_heads=64,
                      num_query_groups=8, ffn_hidden_size=32768, seq_length=8192, vocab_size=131072, dtype="bf16",
                      hybrid_layer_pattern=pattern, mamba_state_dim=256)
    tp = 8
    shard, = megatron_core_shards(model, ParallelPlan(tensor_parallel=tp, sequence_parallel=True))
    norms = (len(pattern) + 1) * 8192  # RMSNorm weights, whole on every TP rank
    assert shard == (model.num_parameters - norms) // tp + norms


# MoE layers (E) in a hybrid: megatron-core's MoE transformer layer, four experts of half the MLP's
# FFN, top-2, so a token's expert GEMMs are those of the dense MLP ('-')
MOE_FIELDS = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=2 * H)
DGX_H100 = get_cluster_preset("dgx-h100")
MOE_PLAN = ParallelPlan(tensor_parallel=TP, sequence_parallel=True, pipeline_parallel=2, data_parallel=2,
                        expert_parallel=2, expert_tensor_parallel=1)


def test_moe_layers_of_a_hybrid_are_megatron_cores_moe_layers_counted_per_stage():
    model = replace(MODEL, hybrid_layer_pattern="M*EM-E", **MOE_FIELDS)
    graph = trace(model, MOE_PLAN)
    # traced kinds M, *, E, - (layers 0-3); rank 0 holds "M*E", rank 1 "M-E"
    assert [[(b.name, b.count) for b in s.blocks if b.kind is BlockKind.LAYER] for s in graph.stages] == [
        [("decoder.layers.0", 1), ("decoder.layers.1", 1), ("decoder.layers.2", 1)],
        [("decoder.layers.0", 1), ("decoder.layers.2", 1), ("decoder.layers.3", 1)]]
    moe = next(b for b in graph.stages[0].blocks if b.name == "decoder.layers.2")
    modules = {n.module.split(".", 3)[-1] for n in moe.nodes}
    assert {"mlp.router", "mlp.experts.local_experts.0.linear_fc1"} <= modules
    assert any(n.group.value == "ep" for n in moe.nodes if not isinstance(n, OpNode))  # the token all-to-all
    assert [[(kind, count) for kind, count, *_ in layer_kinds(s, model)] for s in graph.stages] == [
        [("Mamba", 1), ("attention", 1), ("MoE", 1)], [("Mamba", 1), ("MoE", 1), ("MLP", 1)]]  # as vtrain trace shows
    traced = [sum(b.count * b.num_parameters for b in s.blocks) for s in graph.stages]
    assert traced == megatron_core_shards(model, MOE_PLAN)
    assert model.num_parameters == sum(megatron_core_shards(model, ParallelPlan()))


def test_a_moe_layer_in_place_of_an_mlp_keeps_the_model_flops_and_adds_routing_time():
    """Ablation: E for - with the same expert GEMMs per token: Megatron's FLOP count is unchanged,
    the router, the permutation and the token all-to-all add time."""
    plan = replace(MOE_PLAN, pipeline_parallel=1, data_parallel=4)  # the same GPUs, the dense model without EP
    dense_plan = replace(plan, expert_parallel=1, expert_tensor_parallel=None)
    mlp = estimate(trace(replace(MODEL, hybrid_layer_pattern="M*-M--"), dense_plan), cluster=DGX_H100, global_batch_size=8,
                   profile_db=False)
    moe = estimate(trace(replace(MODEL, hybrid_layer_pattern="M*-M-E", **MOE_FIELDS), plan), cluster=DGX_H100,
                   global_batch_size=8, profile_db=False)
    assert moe.model_flops_per_iteration == mlp.model_flops_per_iteration
    assert moe.iteration_time_ms > mlp.iteration_time_ms and moe.breakdown_ms["ep_comm"] > 0 == mlp.breakdown_ms["ep_comm"]
    assert any(line.startswith("MoE routing balanced") for line in moe.assumptions)


def test_the_mixer_runs_mamba_ssms_kernels_with_the_flops_and_bytes_of_their_math(graph):
    block = next(b for b in graph.stages[0].blocks if b.name == "decoder.layers.0")
    dims = mixer_dims(block.nodes)
    local = MixerDims(batch=1, seq=SEQ, heads=MAMBA_HEADS // TP, head_dim=HEADDIM, groups=GROUPS // TP, state=STATE,
                      chunk=128, d_conv=4, dtype="bfloat16")
    assert dims == {"decoder.layers.0.mixer": local}
    mapped = [n for n in map_nodes(block.nodes, "megatron_core_te") if isinstance(n, OpNode)]
    mixer = {phase: [n for n in mapped if n.phase is phase and n.module == "decoder.layers.0.mixer"]
             for phase in (Phase.FORWARD, Phase.BACKWARD)}
    assert [op_name(n) for n in mixer[Phase.FORWARD]] == [f"mamba_{k}" for k in MIXER_FORWARD]
    assert [op_name(n) for n in mixer[Phase.BACKWARD]] == [f"mamba_{k}" for k in MIXER_BACKWARD]
    x = SEQ * local.heads * HEADDIM
    scan = next(n for n in mixer[Phase.FORWARD] if op_name(n) == "mamba_chunk_scan_fwd")
    assert scan.flops == 2 * x * 128 + 2 * x * STATE  # the diagonal blocks' and the states' products
    assert classify(scan.op) is OpClass.GEMM and classify("mamba.mamba_causal_conv1d_fwd.default") is OpClass.ELEMENTWISE
    # the projections stay GEMMs; the stand-in's 5 forward and 10 backward batched matmuls are gone
    assert [op_name(n) for n in mapped if n.phase is Phase.FORWARD and n.module.endswith("proj")] == ["mm", "mm"]
    assert not [n for n in mapped if op_name(n) == "bmm"]
    # kept for backward: zxBCdt, the scan's output and the norm's rstd (bf16, fp32), not the stand-in's
    kept = sum(n for m, n in block.saved_by_module if m.startswith("decoder.layers.0.mixer")
               and not m.endswith(("in_proj", "out_proj"))) + mixer_saved_delta(block, dims)
    in_proj = (2 * D_INNER + 2 * GROUPS * STATE + MAMBA_HEADS) // TP
    assert kept == 2 * SEQ * in_proj + 2 * x + 4 * SEQ * local.groups


HYBRID_PLAN = """model:
  name: hybrid-small
  family: gpt
  num_layers: {layers}
  hidden_size: 256
  num_attention_heads: 4
  seq_length: {seq}
  vocab_size: 1000
  dtype: bf16
  hybrid_layer_pattern: "{pattern}"
  mamba_state_dim: {state}
  mamba_head_dim: 32
  mamba_num_groups: 2
parallel:
  tensor_parallel: 2
  sequence_parallel: true
  data_parallel: 2
training:
  global_batch_size: 8
  software_stack: megatron_core_te
cluster:
  preset: dgx-h100
"""


def run_of(tmp_path, pattern: str, *, seq: int = 256, state: int = 16):
    path = tmp_path / f"{pattern.replace('*', 'A')}-{seq}-{state}.yaml"
    path.write_text(HYBRID_PLAN.format(layers=len(pattern), seq=seq, pattern=pattern, state=state))
    return load_run_config(path)


def test_mamba_layers_in_place_of_attention_shorten_a_long_sequence_and_the_state_costs(tmp_path):
    long = 65536  # attention's quadratic work well above the host time of the layers' kernels
    attention = estimate(run_of(tmp_path, "M*-**-", seq=long))
    mamba = estimate(run_of(tmp_path, "M*-MM-", seq=long))
    assert mamba.iteration_time_ms < attention.iteration_time_ms  # linear in the sequence, attention quadratic
    small, large = (estimate(run_of(tmp_path, "M*-MM-", seq=long, state=state)) for state in (16, 128))
    assert large.iteration_time_ms > small.iteration_time_ms
    assert large.memory_gib[0].activations_gib > small.memory_gib[0].activations_gib


PRETRAIN_MAMBA = """#!/bin/bash
torchrun --nproc_per_node 4 pretrain_mamba.py --hybrid-layer-pattern 'M*-M-M' --hidden-size 256 \\
    --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 --mamba-state-dim 16 \\
    --mamba-head-dim 32 --mamba-num-groups 2 --tensor-model-parallel-size 2 --sequence-parallel \\
    --micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 --bf16
"""


def test_a_launch_script_a_plan_file_and_a_built_mamba_model_give_one_estimate(tmp_path, run_cli):
    from megatron.core.models.mamba import MambaModel

    from megatron_adapters.gpt import transformer_config
    from megatron_adapters.stand_ins import hybrid_stack_spec

    script, plan = tmp_path / "train_hybrid.sh", tmp_path / "hybrid.yaml"
    script.write_text(PRETRAIN_MAMBA)
    plan.write_text(HYBRID_PLAN.format(layers=6, seq=256, pattern=PATTERN, state=16))
    results = [json.loads(line) for line in run_cli("estimate", str(script), str(plan), "--gpu", "H100",
                                                    "--format", "jsonl", check=True).stdout.splitlines()]
    assert results[0]["iteration_time_ms"] == results[1]["iteration_time_ms"] > 0
    assert results[0]["peak_memory_gib"] == results[1]["peak_memory_gib"] and results[0]["mfu"] == results[1]["mfu"]
    # the Python API: a MambaModel built by megatron-core (TP 2 shard on the fake world), traced as itself
    run = load_run_config(plan)
    with quiet_megatron(), cpu_tracing_patches(), fake_world(run.parallel):
        reset_global_memory_buffer()
        with FakeTensorMode(allow_non_fake_inputs=True):
            built = MambaModel(transformer_config(run.model, run.parallel, layers_per_chunk=6), hybrid_stack_spec(),
                               vocab_size=run.model.padded_vocab_size(2), max_sequence_length=256,
                               hybrid_override_pattern=PATTERN, share_embeddings_and_output_weights=True,
                               position_embedding_type="learned_absolute")
        reset_global_memory_buffer()
        graph = trace(built, seq_length=256)
    read, given = graph.model, run.model
    assert [(m.hybrid_layer_pattern, m.mamba_heads, m.mamba_groups, m.mamba_state, m.ffn_size, m.query_groups, m.tied,
             m.padded_vocab_size(2)) for m in (read, given)] == [(PATTERN, 16, 2, 16, 1024, 4, True, 1024)] * 2
    assert (graph.parallel.tensor_parallel, graph.parallel.sequence_parallel) == (2, True)
    python = estimate(replace(run, model=graph.model, parallel=run.parallel))
    assert python.iteration_time_ms == results[1]["iteration_time_ms"]
