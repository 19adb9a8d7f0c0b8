"""Context parallelism on real megatron-core layers traced on one CP rank's tokens: the synthesized CP
collectives (counts and bytes), the attention FLOPs, activations, estimates and the CLI."""

import json
from collections import Counter
from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import ParallelGroup, Phase
from vtrain_plugin.cost.comm.context_parallel import with_context_parallel
from vtrain_plugin.cost.megatron_flops import megatron_model_flops
from vtrain_plugin.cost.prepare import prepare
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec
from megatron_adapters.conventions import is_core_attention_module

from tests.integration.test_cli_trace import write

SEQ, HEAD_DIM = 128, 32
# GQA: 8 query heads, 2 key/value groups of 32; TP 2 leaves 4 query heads and 1 K/V head per rank
LLAMA = ModelSpec(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  seq_length=SEQ, vocab_size=1000, dtype="bf16")
LLAMA_CP4 = ParallelPlan(tensor_parallel=2, sequence_parallel=True, context_parallel=4, recompute="selective")
GPT = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=SEQ, vocab_size=1000, dtype="bf16")
GPT_CP2 = ParallelPlan(tensor_parallel=2, sequence_parallel=True, context_parallel=2, recompute="full")


@pytest.fixture(scope="module")
def llama():
    return trace(LLAMA, LLAMA_CP4)


@pytest.fixture(scope="module")
def gpt():
    return trace(GPT, GPT_CP2)


def _cp_layer(graph, **plan_changes):
    graph = replace(graph, parallel=replace(graph.parallel, **plan_changes)) if plan_changes else graph
    return with_context_parallel(graph).stages[0].layer_template()


def _collectives(layer):
    return Counter((c.phase.value, c.kind.value, c.nbytes) for c in layer.collectives() if c.group is ParallelGroup.CP)


def test_the_layer_is_traced_on_one_cp_ranks_tokens(llama):
    stage = llama.stages[0]
    assert llama.seq_length == SEQ and stage.activation_shape == (SEQ // 4 // 2, 1, 256)  # / CP / TP (SP)
    scores = [op for op in stage.layer_template().ops(Phase.FORWARD) if op.op == "aten.baddbmm.default"]
    assert [op.key.input_shapes[0] for op in scores] == [(4, 32, 32)]  # 4 heads, 32 x 32 local scores


def test_ring_attention_collectives_of_one_layer_are_exact(llama):
    chunk = 2 * 1 * (SEQ // 4) * HEAD_DIM * 2  # K and V: 1 head x 32 tokens x 32, bf16 = 4 KiB
    layer = _cp_layer(llama)
    assert _collectives(layer) == Counter({
        ("forward", "send", chunk): 3, ("forward", "recv", chunk): 3,  # CP - 1 ring steps
        ("recompute", "send", chunk): 3, ("recompute", "recv", chunk): 3,  # selective recompute re-runs them
        # backward, CP messages: K/V, K/V + dK/dV twice, dK/dV
        ("backward", "send", chunk): 2, ("backward", "recv", chunk): 2,
        ("backward", "send", 2 * chunk): 2, ("backward", "recv", 2 * chunk): 2})
    cp = [c for c in layer.collectives() if c.group is ParallelGroup.CP]
    assert all(c.synthesized and c.group_size == 4 and c.module == "decoder.layers.0.self_attention.core_attention"
               for c in cp)
    assert not any(is_core_attention_module(op.module) and op.op.startswith("aten.") for op in layer.ops())


def test_all_gather_attention_collectives_of_one_layer_are_exact(llama):
    gathered = 4 * 2 * 1 * (SEQ // 4) * HEAD_DIM * 2
    assert _collectives(_cp_layer(llama, cp_comm_type="all_gather")) == Counter({
        ("forward", "all_gather", gathered): 1, ("recompute", "all_gather", gathered): 1,
        ("backward", "all_gather", gathered): 1, ("backward", "reduce_scatter", gathered): 1})


def test_multi_head_attention_exchanges_every_heads_keys(gpt):
    chunk = 2 * 4 * (SEQ // 2) * HEAD_DIM * 2  # 4 heads per TP rank, 64 tokens per CP rank
    assert _collectives(_cp_layer(gpt)) == Counter({
        ("forward", "send", chunk): 1, ("forward", "recv", chunk): 1,
        ("recompute", "send", chunk): 1, ("recompute", "recv", chunk): 1,  # full recompute
        ("backward", "send", chunk): 2, ("backward", "recv", chunk): 2})


def _attention_flops(layer, phase, *, cp):
    return sum(op.flops for op in layer.ops(phase) if is_core_attention_module(op.module)
               and (op.op.startswith("te.") if cp else True))


def test_attention_kernel_flops_are_the_local_queries_against_every_key_causal_half(llama):
    b_heads, s_l = 4, SEQ // 4
    costed = _cp_layer(llama)
    forward = 4 * b_heads * s_l * SEQ * HEAD_DIM // 2  # score and context GEMMs, causal half
    assert _attention_flops(costed, Phase.FORWARD, cp=True) == forward
    assert _attention_flops(costed, Phase.RECOMPUTE, cp=True) == forward
    assert _attention_flops(costed, Phase.BACKWARD, cp=True) == 5 * forward // 2  # TE recomputes the scores
    # the 4 CP ranks together: the causal half of the whole sequence's attention on this TP rank
    assert 4 * forward == 4 * b_heads * SEQ * SEQ * HEAD_DIM // 2


def test_model_flops_do_not_depend_on_how_the_sequence_is_split(llama):
    """Model FLOPs are the traced ones with the core attention's counted CP times (the local queries
    against every rank's keys): over the CP ranks, those of the layer traced on the whole sequence."""
    whole = prepare(trace(LLAMA, replace(LLAMA_CP4, context_parallel=1)), "megatron_core_te")
    split = prepare(llama, "megatron_core_te")
    traced = llama.stages[0].layer_template()
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE):
        assert split.flops[phase] == llama.flops(phase) + 3 * traced.count * _attention_flops(traced, phase, cp=False)
        assert 4 * split.flops[phase] == whole.flops[phase]


def test_activations_per_rank_are_those_of_seq_over_cp_tokens(gpt):
    # full recompute keeps each layer's input, s / cp / tp tokens (SP) x hidden in bf16 (the local
    # spec's [s/cp, s/cp] attention mask is the chunk's, outside the layers)
    s_l = SEQ // 2
    assert gpt.stages[0].layer_template().activation_nbytes == s_l // 2 * 1 * 256 * 2


def test_estimate_counts_every_cp_rank(llama):
    cluster = get_cluster_preset("dgx-h100")
    training = TrainingSpec(global_batch_size=8)
    ring = estimate(llama, cluster=cluster, training=training)
    gathered = estimate(replace(llama, parallel=replace(LLAMA_CP4, cp_comm_type="all_gather")), cluster=cluster,
                        training=training)
    assert ring.num_gpus == gathered.num_gpus == 8 and ring.num_microbatches == 8
    assert ring.tokens_per_second == pytest.approx(8 * SEQ / (ring.iteration_time_ms / 1e3))
    assert ring.software_stack == "megatron_core_te"
    prepared = prepare(llama, "megatron_core_te")
    traced_flops = sum(prepared.flops[p] for p in Phase) * 2 * 4 * 8  # x TP x CP x m
    seconds = ring.iteration_time_ms / 1e3
    assert ring.hardware_tflops_per_gpu == pytest.approx(traced_flops / seconds / 8 / 1e12, rel=1e-12)
    megatron_flops = megatron_model_flops(LLAMA, sequences=8, tensor_parallel=2)  # CP splits it, adds none
    assert ring.tflops_per_gpu == pytest.approx(megatron_flops / seconds / 8 / 1e12, rel=1e-12)
    assert gathered.breakdown_ms["cp_comm"] > 0  # nothing hides an all-gather
    for e in (ring, gathered):
        assert sum(e.breakdown_ms.values()) == pytest.approx(e.iteration_time_ms, rel=1e-9)


def test_trace_json_shows_the_synthesized_cp_attention(tmp_path, run_cli):
    plan = {"model": LLAMA.to_dict(), "parallel": LLAMA_CP4.to_dict(), "training": {"global_batch_size": 8}}
    proc = run_cli("trace", write(tmp_path, "cp.json", plan), "--format", "json", check=True)
    (stage,) = json.loads(proc.stdout)["stages"]
    cp = [c for c in stage["collectives"] if c["group"] == "cp"]
    assert cp and all(c["synthesized"] and c["group_size"] == 4 for c in cp)
    assert sum(c["count"] for c in cp if c["kind"] == "send" and c["phase"] == "forward") == 3 * 4  # x 4 layers
    assert any(o["op"] == "te.fused_attention.default" and o["input_shapes"][1] == [SEQ // 4, 1, HEAD_DIM]
               for o in stage["stack_kernels"])  # a ring step: the local queries against one rank's keys
    assert any(o["op"] == "aten.baddbmm.default" for o in stage["ops"])  # the traced ops as traced


@pytest.mark.parametrize("parallel, training, message", [
    ({"context_parallel": 3}, {}, "context_parallel_size (3) must divide seq_length (128)"),
    ({"context_parallel": 128}, {},
     "2 * context_parallel_size (2 * 128 = 256) must divide seq_length (128): Megatron's load-balanced causal split"),
    ({"tensor_parallel": 2}, {"tp_comm_overlap": True}, "training.tp_comm_overlap requires parallel.sequence_parallel"),
])
def test_bad_context_parallel_input_is_one_line_exit_2(tmp_path, run_cli, parallel, training, message):
    plan = {"model": LLAMA.to_dict(), "parallel": parallel, "training": {"global_batch_size": 8, **training}}
    proc = run_cli("estimate", write(tmp_path, "bad.json", plan))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
