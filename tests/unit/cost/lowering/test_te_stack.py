"""The mapping of traced megatron-core local-spec ops onto Megatron-Core + TransformerEngine kernels
(``megatron_core_te``), pinned kernel by kernel on a small real GPT layer and a small real Llama layer
(RMSNorm, SwiGLU, RoPE, grouped-query attention, sequence parallelism), in bf16 and in FP8."""

from __future__ import annotations

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import BlockKind, CollectiveNode, OpNode, Phase
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.cost.lowering.fp8 import fp8_weight_numel
from vtrain_plugin.cost.lowering.dropout_masks import dropout_mask_delta
from vtrain_plugin.cost.lowering.megatron_core_te import (fused_attention_saved_delta, fused_softmax_saved_delta,
                                                         unfused_backward_score_nbytes)
from vtrain_plugin.cost.memory import all_held
from vtrain_plugin.cost.stack_memory import stack_rank_memory
from vtrain_plugin.cost.lowering.te_saved import te_saved_delta
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, Fp8Settings, SoftwareStack
from megatron_adapters.conventions import SHARED_BY_CORE_ATTENTION

TE = "megatron_core_te"
H, HEADS, GROUPS, S, MB, TP = 64, 4, 2, 32, 2, 2
T = S * MB  # tokens of one micro-batch
HP, GP, D = HEADS // TP, GROUPS // TP, H // HEADS  # heads and query groups on one TP rank, head dim
F_GPT, F_LLAMA = 4 * H // TP, 256 // TP  # FFN width on one rank (Llama: 8h/3 rounded up to 256)
Q, K_GQA = MB * S * HP * D, MB * S * GP * D  # query / key elements of one rank
LSE = 4 * MB * HP * S  # fp32 softmax statistics of the fused attention
ATTENTION_FLOPS = 4 * MB * HP * S * S * D // 2  # causal half of QK^T and PV
HYBRID = Fp8Settings(format=Fp8Format.HYBRID)


def _model(family: str, seq_length: int = S) -> ModelSpec:
    return ModelSpec(family=family, num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=seq_length,
                     vocab_size=256, dtype="bf16", num_query_groups=GROUPS if family == "llama" else None)


def _trace(family: str, *, sequence_parallel: bool = False, seq_length: int = S, recompute: str = "none"):
    from vtrain_plugin.capture.tracer import trace

    return trace(_model(family, seq_length), ParallelPlan(tensor_parallel=TP, micro_batch_size=MB,
                                                          sequence_parallel=sequence_parallel, recompute=recompute))


@pytest.fixture(scope="module")
def gpt():
    return _trace("gpt")


@pytest.fixture(scope="module")
def llama():
    return _trace("llama", sequence_parallel=True)


def kernels(nodes, phase: Phase) -> list[tuple]:
    """(op, FLOPs, bytes) of each kernel and (kind, bytes) of each collective of ``phase``, in order."""
    return [(n.op.split(".")[1], n.flops, n.nbytes) if isinstance(n, OpNode) else (n.kind.value, n.nbytes)
            for n in nodes if n.phase is phase and (not isinstance(n, OpNode) or n.launches_kernel)]


def gemm(m: int, k: int, n: int, in_bytes: int = 2, out_bytes: int = 2) -> tuple:
    return ("mm" if in_bytes == 2 else "_scaled_mm", 2 * m * k * n, in_bytes * (m * k + k * n) + out_bytes * m * n)


LAYER_NORM = ("layer_norm", 0, 4 * T * H + 4 * H + 4 * T)  # as traced: x, y, gamma, beta, bf16 statistics
LAYER_NORM_BWD = ("layer_norm_backward", 0, 25344)  # as traced
BIAS_DROPOUT_ADD = ("bias_dropout_add_fused_train", 0, 7 * T * H + 2 * H)
BIAS_DROPOUT_ADD_BWD = ("bias_dropout_add_fused_train_backward", 0, 5 * T * H)
RMS_NORM_SP = ("rms_norm", 0, 2 * 2 * T // TP * H + 2 * H + 4 * T // TP)  # x in, y out, gamma, fp32 rstd
RMS_NORM_BWD_SP = ("rms_norm_backward", 0, 3 * 2 * T // TP * H + 2 * 2 * H + 4 * T // TP)
AR, GATHER, SCATTER = ("all_reduce", 2 * T * H), ("all_gather", 2 * T * H), ("reduce_scatter", 2 * T * H)


def test_gpt_layer_forward(gpt):
    mapped = map_nodes(gpt.stages[0].layer_template().nodes, TE)
    assert kernels(mapped, Phase.FORWARD) == [
        LAYER_NORM,
        gemm(T, H, 3 * H // TP),  # QKV, bias in the GEMM epilogue
        ("fused_attention", ATTENTION_FLOPS, 2 * (2 * Q + 2 * Q) + LSE),  # no scores, mask, dropout or copies
        gemm(T, H // TP, H),
        AR,
        BIAS_DROPOUT_ADD,
        LAYER_NORM,
        gemm(T, H, F_GPT),
        ("bias_gelu_fused", 0, 4 * T * F_GPT + 2 * F_GPT),
        gemm(T, F_GPT, H),
        AR,
        BIAS_DROPOUT_ADD,
    ]


def test_gpt_layer_backward(gpt):
    mapped = map_nodes(gpt.stages[0].layer_template().nodes, TE)
    bias_grad = ("sum", 0, 2 * T * H + 2 * H)  # of the projection / FC2 bias, as traced
    assert kernels(mapped, Phase.BACKWARD) == [
        BIAS_DROPOUT_ADD_BWD, bias_grad,
        gemm(T, H, F_GPT), gemm(T, H, F_GPT),
        ("bias_gelu_fused_backward", 0, 6 * T * F_GPT), ("sum", 0, 2 * T * F_GPT + 2 * F_GPT),
        gemm(T, F_GPT, H), AR, gemm(F_GPT, T, H),
        LAYER_NORM_BWD, ("add", 0, 6 * T * H),  # the residual's two gradients
        BIAS_DROPOUT_ADD_BWD, bias_grad,
        gemm(T, H, H // TP), gemm(T, H, H // TP),
        ("fused_attention_backward", 5 * ATTENTION_FLOPS // 2, 2 * (4 * Q + 4 * Q) + LSE),
        ("cat", 0, 2 * 2 * 3 * Q),  # the QKV gradients into one tensor
        gemm(T, 3 * H // TP, H), AR, gemm(3 * H // TP, T, H),  # no bias-gradient sum: in the wgrad epilogue
        LAYER_NORM_BWD, ("add", 0, 6 * T * H),
    ]


def test_gpt_layer_optimizer_is_four_multi_tensor_passes(gpt):
    layer = gpt.stages[0].layer_template()
    params = layer.num_parameters
    assert params == 3 * H // TP * (H + 1) + H // TP * H + H + F_GPT * (H + 1) + H * F_GPT + H + 4 * H
    mapped = map_nodes(layer.nodes, TE)
    assert kernels(mapped, Phase.OPTIMIZER) == [("multi_tensor_l2norm", 0, 4 * params),
                                                ("multi_tensor_scale", 0, 8 * params),
                                                ("multi_tensor_adam", 0, 28 * params),
                                                ("multi_tensor_copy", 0, 6 * params)]


def test_llama_layer_forward(llama):
    mapped = map_nodes(llama.stages[0].layer_template().nodes, TE)
    qkv = (HP + 2 * GP) * D
    rope = 2 * 2 + 0  # bf16 in and out per element, plus the fp32 frequencies
    assert kernels(mapped, Phase.FORWARD) == [
        RMS_NORM_SP, GATHER,
        gemm(T, H, qkv),
        ("fused_rope", 0, rope * Q + 4 * S * D), ("fused_rope", 0, rope * K_GQA + 4 * S * D),
        ("fused_attention", ATTENTION_FLOPS, 2 * (2 * Q + 2 * K_GQA) + LSE),  # keys and values not expanded
        gemm(T, H // TP, H), SCATTER,
        ("add", 0, 3 * 2 * T // TP * H),
        RMS_NORM_SP, GATHER,
        gemm(T, H, 2 * F_LLAMA),
        ("swiglu_fused", 0, 3 * 2 * T * F_LLAMA),
        gemm(T, F_LLAMA, H), SCATTER,
        ("add", 0, 3 * 2 * T // TP * H),
    ]


def test_llama_layer_backward(llama):
    mapped = map_nodes(llama.stages[0].layer_template().nodes, TE)
    qkv = (HP + 2 * GP) * D
    assert kernels(mapped, Phase.BACKWARD) == [
        GATHER, gemm(T, H, F_LLAMA), gemm(T, H, F_LLAMA),
        ("swiglu_fused_backward", 0, 5 * 2 * T * F_LLAMA),
        GATHER, gemm(T, 2 * F_LLAMA, H), SCATTER, gemm(2 * F_LLAMA, T, H),
        RMS_NORM_BWD_SP, ("add", 0, 3 * 2 * T // TP * H),
        GATHER, gemm(T, H, H // TP), gemm(T, H, H // TP),
        ("fused_attention_backward", 5 * ATTENTION_FLOPS // 2, 2 * (4 * Q + 4 * K_GQA) + LSE),
        ("fused_rope_backward", 0, 4 * K_GQA + 4 * S * D), ("fused_rope_backward", 0, 4 * Q + 4 * S * D),
        ("cat", 0, 2 * 2 * (Q + 2 * K_GQA)),
        GATHER, gemm(T, qkv, H), SCATTER, gemm(qkv, T, H),
        RMS_NORM_BWD_SP, ("add", 0, 3 * 2 * T // TP * H),
    ]


def test_llama_layer_in_fp8_hybrid(llama):
    layer = llama.stages[0].layer_template()
    mapped = map_nodes(layer.nodes, TE, HYBRID)
    qkv = (HP + 2 * GP) * D
    fp8_gather = ("all_gather", T * H)  # TE gathers the FP8 norm output

    def fp8(m, k, n):
        return gemm(m, k, n, in_bytes=1)

    def cast(n):  # bf16 in; FP8 copy and its transpose out
        return ("cast_transpose", 0, 4 * n)

    forward = kernels(mapped, Phase.FORWARD)
    assert forward[:3] == [("rms_norm", 0, RMS_NORM_SP[2] - T // TP * H), fp8_gather, fp8(T, H, qkv)]
    assert forward[6:9] == [cast(T * H // TP), fp8(T, H // TP, H), SCATTER]
    assert forward[10:] == [("rms_norm", 0, RMS_NORM_SP[2] - T // TP * H), fp8_gather, fp8(T, H, 2 * F_LLAMA),
                            ("swiglu_fused", 0, 3 * 2 * T * F_LLAMA), cast(T * F_LLAMA), fp8(T, F_LLAMA, H), SCATTER,
                            ("add", 0, 3 * 2 * T // TP * H)]
    backward = kernels(mapped, Phase.BACKWARD)
    assert backward[:4] == [GATHER, cast(T * H), fp8(T, H, F_LLAMA), fp8(T, H, F_LLAMA)]
    assert backward[5:10] == [fp8_gather, cast(T * 2 * F_LLAMA), ("fp8_transpose", 0, 2 * T * H),
                              fp8(T, 2 * F_LLAMA, H), SCATTER]
    gemms = [n for n in mapped if isinstance(n, OpNode) and n.op == "aten._scaled_mm.default"]
    assert len(gemms) == 12  # 4 linears x (forward, dgrad, wgrad)
    assert {n.key.dtypes for n in gemms if n.phase is Phase.BACKWARD} == {("float8_e5m2", "float8_e4m3fn")}
    assert kernels(mapped, Phase.OPTIMIZER)[:4] == [cast(H * qkv), cast(H // TP * H), cast(H * 2 * F_LLAMA),
                                                    cast(F_LLAMA * H)]  # each weight once per iteration
    assert fp8_weight_numel(layer.nodes) == H * qkv + H // TP * H + H * 2 * F_LLAMA + F_LLAMA * H
    attention = [n for n in mapped if isinstance(n, OpNode) and "fused_attention" in n.op]
    assert [n.key.dtypes[0] for n in attention] == ["bfloat16", "bfloat16"]  # attention stays in bf16


def test_current_scaling_takes_each_amax_first_and_norms_write_bf16(gpt):
    nodes = gpt.stages[0].layer_template().nodes
    delayed = kernels(map_nodes(nodes, TE, Fp8Settings(format=Fp8Format.E4M3)), Phase.FORWARD)
    current = kernels(map_nodes(nodes, TE, Fp8Settings(format=Fp8Format.E4M3, recipe=Fp8Recipe.TENSORWISE)), Phase.FORWARD)
    assert delayed[:2] == [("layer_norm", 0, LAYER_NORM[2] - T * H), gemm(T, H, 3 * H // TP, in_bytes=1)]
    assert current[:4] == [LAYER_NORM, ("compute_amax", 0, 2 * T * H), ("cast_transpose", 0, 4 * T * H),
                           gemm(T, H, 3 * H // TP, in_bytes=1)]
    assert sum(1 for k in current if k[0] == "compute_amax") == 4


def test_head_runs_the_fused_cross_entropy_with_one_all_reduce(gpt):
    head = next(b for b in gpt.stages[0].blocks if b.kind.value == "head")
    mapped = map_nodes(head.nodes, TE)
    logits = T * 256 // TP  # vocabulary-parallel logits of one rank
    forward = kernels(mapped, Phase.FORWARD)
    assert forward[:7] == [LAYER_NORM, gemm(T, H, 256 // TP), ("clone", 0, 16 * T),
                           ("vocab_parallel_ce_logits_max", 0, 6 * logits), ("all_reduce", 4 * T),
                           ("vocab_parallel_ce_predicted_logits", 0, 8 * logits), ("all_reduce", 8 * T)]
    assert forward[7] == ("vocab_parallel_ce_loss", 0, 8 * logits)
    assert ("vocab_parallel_ce_gradients", 0, 8 * logits) in kernels(mapped, Phase.BACKWARD)
    collectives = [n for n in mapped if isinstance(n, CollectiveNode) and n.phase is Phase.FORWARD]
    assert len(collectives) == 2 and len([n for n in head.nodes if isinstance(n, CollectiveNode)
                                          and n.phase is Phase.FORWARD]) == 3


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fused_attention_keeps_activations_linear_in_the_sequence(family, sequence_parallel):
    """The traced local spec keeps score-sized tensors (quadratic in the sequence); the fused kernel
    keeps none, so a layer's activations under the TE stack are exactly proportional to it."""
    traced, fused = {}, {}
    for s in (32, 64, 128):
        layer = _trace(family, sequence_parallel=sequence_parallel, seq_length=s).stages[0].layer_template()
        traced[s] = layer.activation_nbytes
        fused[s] = layer.activation_nbytes + dropout_mask_delta(layer) + fused_attention_saved_delta(layer.nodes)
    assert traced[64] > 2 * traced[32]
    assert (fused[64], fused[128]) == (2 * fused[32], 4 * fused[32])


def test_a_fused_softmax_keeps_its_output_in_the_model_dtype(gpt):
    """TE's unfused attention and Megatron's scaled masked softmax (megatron_deepspeed_2023) keep the
    probabilities in bf16 where the traced softmax keeps fp32: 2 bytes less per score."""
    assert fused_softmax_saved_delta(gpt.stages[0].layer_template().nodes) == -2 * MB * HP * S * S


def test_without_attention_dropout_the_context_gemm_keeps_the_fused_softmax_output():
    """Llama has no attention dropout: the bf16 probabilities the context GEMM keeps are the fused
    softmax's output, so the traced fp32 softmax output (4 bytes per score) goes entirely."""
    assert fused_softmax_saved_delta(_trace("llama").stages[0].layer_template().nodes) == -4 * MB * HP * S * S
    assert fused_softmax_saved_delta(_trace("llama", recompute="selective").stages[0].layer_template().nodes) == 0



def test_te_unfused_attention_backward_allocates_the_probabilities_gradient(gpt):
    """TE's unfused attention: the bf16 gradient of the probabilities (softmax backward in place),
    and the recomputed probabilities beside it when the attention is recomputed."""
    scores = MB * HP * S * S
    assert unfused_backward_score_nbytes(gpt.stages[0].layer_template().nodes) == 2 * scores
    assert unfused_backward_score_nbytes(_trace("llama", recompute="selective").stages[0].layer_template().nodes) \
        == 4 * scores
    assert unfused_backward_score_nbytes(gpt.stages[0].blocks[0].nodes) == 0  # the embedding

def test_no_delta_when_attention_is_recomputed():
    layer = _trace("llama", recompute="selective").stages[0].layer_template()
    assert fused_attention_saved_delta(layer.nodes) == 0


def test_fp8_needs_the_te_stack(gpt):
    nodes = gpt.stages[0].layer_template().nodes
    with pytest.raises(ConfigError, match="^training.fp8 'hybrid' needs software_stack megatron_core_te "
                                          r"\(got megatron_deepspeed_2023\)$"):
        map_nodes(nodes, "megatron_deepspeed_2023", HYBRID)


def test_fp8_gemms_run_at_the_fp8_rate_and_fused_attention_at_its_own_efficiency():
    """On H100 with the TE constants: a large FP8 GEMM's compute time is half the bf16 one (1979 vs
    989 TFLOP/s, same tiles); the fused attention kernel runs at attention_efficiency of the bf16 peak."""
    from vtrain_plugin.core.graph import KernelKey
    from vtrain_plugin.cost.kernels.model import KernelModel
    from vtrain_plugin.hardware.calibration import calibration_for
    from vtrain_plugin.hardware.devices import get_device

    h100 = get_device("h100-sxm")
    constants = calibration_for("h100-sxm", TE).constants
    model = KernelModel(h100, constants)
    n = 8192
    shapes = ((n, n), (n, n))
    bf16 = OpNode(key=KernelKey(op="aten.mm.default", input_shapes=shapes, dtypes=("bfloat16",) * 2),
                  phase=Phase.FORWARD, module="m", flops=2 * n**3, nbytes=6 * n * n)
    fp8 = OpNode(key=KernelKey(op="aten._scaled_mm.default", input_shapes=shapes, dtypes=("float8_e4m3fn",) * 2),
                 phase=Phase.FORWARD, module="m", flops=2 * n**3, nbytes=4 * n * n)
    overhead = constants.kernel_overhead_ns
    assert model.duration_ns(fp8) - overhead == pytest.approx((model.duration_ns(bf16) - overhead) * 989 / 1979)
    attention = OpNode(key=KernelKey(op="te.fused_attention.default", input_shapes=((8192, 1, 16, 128),) * 3,
                                     dtypes=("bfloat16",) * 3), phase=Phase.FORWARD, module="a", flops=10**12,
                       nbytes=10**6)
    assert model.duration_ns(attention) == pytest.approx(10**12 / (989e3 * constants.attention_efficiency) + overhead)


def test_python_api_estimates_fp8_on_h100_and_refuses_it_on_a100(llama):
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.hardware.clusters import get_cluster_preset
    from vtrain_plugin.specs.training import TrainingSpec

    h100 = get_cluster_preset("dgx-h100")
    bf16 = estimate(llama, cluster=h100, training=TrainingSpec(global_batch_size=4))
    fp8 = estimate(llama, cluster=h100, training=TrainingSpec(global_batch_size=4, fp8="hybrid"))
    assert (bf16.software_stack, bf16.fp8, fp8.software_stack, fp8.fp8) == (TE, None, TE, "hybrid")
    cache = sum(b.count * 2 * fp8_weight_numel(b.nodes) for b in llama.stages[0].blocks)  # FP8 copy, transpose
    assert fp8.memory_gib[0].weights_gib - bf16.memory_gib[0].weights_gib == pytest.approx(cache / 2**30)
    assert fp8.to_dict()["fp8"] == "hybrid" and fp8.mfu > 0
    with pytest.raises(ConfigError, match=r"^training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb"):
        estimate(llama, cluster=get_cluster_preset("dgx-a100"), training=TrainingSpec(global_batch_size=4, fp8="hybrid"))


def test_the_causal_mask_is_a_stage_block_that_fused_attention_does_not_keep():
    """The local spec's softmax keeps the ``s x s`` causal mask all layers of a chunk share: a stage
    block of its own, which the TE stack drops (its causal kernels take no mask). A checkpoint around
    the core attention keeps the mask as one of its inputs: then it stays with the chunk."""
    def stage_blocks(graph):
        return {b.name: b.activation_nbytes for b in graph.stages[0].blocks if b.kind is BlockKind.STAGE}

    none, selective = _trace("llama"), _trace("llama", recompute="selective")
    mask = S * S  # (1, 1, s, s) bool
    assert stage_blocks(none)[SHARED_BY_CORE_ATTENTION] == mask
    assert SHARED_BY_CORE_ATTENTION not in stage_blocks(selective)
    assert stage_blocks(selective)["stage"] == stage_blocks(none)["stage"] + mask

    def activations(graph, stack):
        memory = stack_rank_memory(graph, all_held, stack)
        return memory[0].activations_gib * GIB

    layer = none.stages[0].layer_template()
    assert layer.count == 2
    def fused_modules(graph):  # what TE's norms and SwiGLU keep less than the traced ones
        return sum(b.count * te_saved_delta(b, fp8=False) for b in graph.stages[0].blocks)

    def local_step(graph):  # what the local attention's step holds and its backward adds
        return graph.stages[0].held_nbytes + graph.stages[0].backward_peak_nbytes

    def fused_step(graph):  # the same without what the local core attention allocates (TE's)
        return graph.stages[0].held_outside_attention_nbytes + graph.stages[0].backward_peak_outside_attention_nbytes

    assert fused_modules(none) < 0
    assert (activations(none, SoftwareStack.MEGATRON_CORE_TE) - activations(none, SoftwareStack.LOCAL_SPEC)
            == pytest.approx(2 * fused_attention_saved_delta(layer.nodes) + fused_modules(none) - mask
                             + fused_step(none) - local_step(none), abs=1e-3))
    assert (activations(selective, SoftwareStack.MEGATRON_CORE_TE) - activations(selective, SoftwareStack.LOCAL_SPEC)
            == pytest.approx(fused_modules(selective) + fused_step(selective) - local_step(selective), abs=1e-3))
