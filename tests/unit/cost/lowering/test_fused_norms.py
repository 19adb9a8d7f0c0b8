"""Norms as a GPU's fused kernel keeps them (input and fp32 row statistics) against the traced CPU
step's, on small real megatron-core layers: torch's composite RMSNorm keeps two fp32 copies of its
input and its rstd, LayerNorm (``native_layer_norm``) its input and statistics in the model dtype."""

from __future__ import annotations

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import BlockKind
from vtrain_plugin.cost.lowering.fused_norms import fused_norm_saved_by_module, fused_norm_saved_delta
from vtrain_plugin.cost.memory import all_held
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.specs.cluster import GpuArchitecture
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import SoftwareStack

H, HEADS, S, MB = 64, 4, 32, 2
N, ROWS = S * MB * H, S * MB  # a layer norm's input elements and rows


def _graph(family: str, recompute: str = "none", **model):
    spec = ModelSpec(family=family, num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                     vocab_size=256, dtype="bf16", **model)
    return trace(spec, ParallelPlan(micro_batch_size=MB, recompute=recompute))


def _layer(graph):
    return next(b for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)


def test_an_rms_norm_keeps_its_bf16_input_and_fp32_rstd_instead_of_two_fp32_copies():
    delta = fused_norm_saved_by_module(_layer(_graph("llama")))
    fused, traced = 2 * N + 4 * ROWS, 2 * 4 * N + 4 * ROWS  # the composite keeps its rstd too
    assert delta == {"decoder.layers.0.input_layernorm": fused - traced,
                     "decoder.layers.0.pre_mlp_layernorm": fused - traced}


def test_qk_norms_run_over_each_head():
    delta = fused_norm_saved_by_module(_layer(_graph("llama", qk_layernorm=True, num_query_groups=2)))
    # queries: N elements in rows of a head (their rstd kept either way), keys half as many (GQA 4/2)
    assert delta["decoder.layers.0.self_attention.q_layernorm"] == 2 * N - 8 * N
    assert delta["decoder.layers.0.self_attention.k_layernorm"] == (2 * N - 8 * N) // 2


def test_a_layer_norm_differs_only_in_its_statistics_dtype():
    """LayerNorm traces as native_layer_norm, keeping its input as the fused kernel does; the CPU
    keeps mean and rstd in bf16, a GPU in fp32."""
    assert fused_norm_saved_delta(_layer(_graph("gpt"))) == 2 * 2 * (4 - 2) * ROWS


def test_a_recomputed_norm_keeps_nothing_to_correct():
    assert fused_norm_saved_delta(_layer(_graph("llama", recompute="full"))) == 0


def test_the_local_spec_counts_them_on_a_gpu_only():
    graph = _graph("llama")
    def activations(architecture):
        return stack_rank_memory(graph, all_held, SoftwareStack.LOCAL_SPEC, None, architecture)[0].activations_gib
    layers = sum(b.count for b in graph.stages[0].blocks if b.kind is BlockKind.LAYER)
    final = 2 * N - 8 * N
    assert (activations(GpuArchitecture.HOPPER) - activations(GpuArchitecture.CPU)) * 2**30 == \
        layers * fused_norm_saved_delta(_layer(graph)) + final
