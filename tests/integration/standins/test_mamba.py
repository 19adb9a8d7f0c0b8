"""Mamba hybrids (Nemotron-H) from megatron-core's own MambaModel / MambaStack on the fake process
group, the mixer a stand-in with MambaMixer's constructor doing the Mamba-2 math in torch ops: its
parameters are MambaMixer's, its scan is the chunked SSD algorithm (checked against the sequential
recurrence), and its traced GEMMs carry the SSD kernels' FLOPs."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from megatron_adapters.cpu_patches import cpu_tracing_patches
from megatron_adapters.stand_ins import ChunkedScan, LocalNorm
from tests.integration.standins.recording import CPU_FIELDS, record
from vtrain_plugin.core.graph import CollectiveKind as K
from vtrain_plugin.core.graph import Phase
from vtrain_plugin.specs.parallel import ParallelPlan

S, B, H, N, FFN, VOCAB = 32, 2, 64, 4, 128, 256
STATE, HEADDIM, GROUPS, CHUNK, D_CONV = 16, 8, 2, 16, 4
D_INNER = 2 * H  # expand 2
HEADS = D_INNER // HEADDIM  # 16
IN_PROJ = 2 * D_INNER + 2 * GROUPS * STATE + HEADS  # z, x, B, C, dt
CONV = D_INNER + 2 * GROUPS * STATE  # x, B, C
PATTERN = "M*-"  # Mamba, attention, MLP
T = S * B
MIXER = "decoder.layers.0.mixer"


def mamba_layer_parameters(hidden: int, d_inner: int, heads: int, groups: int, state: int, d_conv: int = 4) -> int:
    """One Mamba layer, from megatron-core's MambaMixer (and the TE spec's norm fused into in_proj)."""
    conv = d_inner + 2 * groups * state
    return (hidden  # norm
            + hidden * (2 * d_inner + 2 * groups * state + heads)  # in_proj
            + conv * d_conv + conv  # depthwise conv1d, bias
            + 3 * heads  # dt_bias, A_log, D
            + d_inner  # gated RMSNorm
            + d_inner * hidden)  # out_proj


def config(tp: int = 1, layers: int = len(PATTERN), **dims):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(hidden_size=H, num_attention_heads=N, ffn_hidden_size=FFN, mamba_state_dim=STATE,
                  mamba_head_dim=HEADDIM, mamba_num_groups=GROUPS)
    fields.update(dims)
    return TransformerConfig(num_layers=layers, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                             normalization="RMSNorm", is_hybrid_model=True, tensor_model_parallel_size=tp,
                             sequence_parallel=tp > 1, activation_func=lambda x: torch.relu(x) ** 2,  # squared ReLU
                             **fields, **CPU_FIELDS)


def mamba_model(tp: int = 1):
    from megatron.core.models.mamba import MambaModel

    from megatron_adapters.stand_ins import hybrid_stack_spec

    return MambaModel(config(tp), hybrid_stack_spec(mamba_chunk_size=CHUNK), vocab_size=VOCAB, max_sequence_length=S,
                      hybrid_override_pattern=PATTERN, position_embedding_type="none")


def run(tp: int = 1):
    def inputs():
        tokens = torch.zeros(B, S, dtype=torch.long)
        return tokens, None, torch.ones(1, 1, S, S, dtype=torch.bool), tokens

    return record(lambda: mamba_model(tp), inputs, plan=ParallelPlan(tensor_parallel=tp, sequence_parallel=tp > 1),
                  call=lambda model, a: model(a[0], a[1], a[2], labels=a[3]))


@pytest.fixture(scope="module")
def tp1():
    return run()


def test_the_chunked_scan_is_the_selective_state_space_recurrence():
    torch.manual_seed(0)
    b, length, h, p, g, n = 2, 22, 4, 3, 2, 5
    x, dt = torch.randn(b, length, h * p), torch.randn(b, length, h)
    A, dt_bias, D = -torch.rand(h), torch.randn(h), torch.randn(h)
    Bm, Cm = torch.randn(b, length, g * n), torch.randn(b, length, g * n)
    # the recurrence: state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_tᵀ; y_t = state_t C_t + D x_t
    d = F.softplus(dt + dt_bias).double()
    Bh = Bm.view(b, length, g, n).repeat_interleave(h // g, dim=2).double()
    Ch = Cm.view(b, length, g, n).repeat_interleave(h // g, dim=2).double()
    xs = x.view(b, length, h, p).double()
    state, ys = torch.zeros(b, h, p, n, dtype=torch.float64), []
    for t in range(length):
        state = (state * torch.exp(d[:, t] * A.double())[..., None, None]
                 + d[:, t][..., None, None] * xs[:, t][..., None] * Bh[:, t][:, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + D.double()[None, :, None] * xs[:, t])
    expected = torch.stack(ys, 1).reshape(b, length, h * p)
    for chunk in (4, 8, 5, 64):  # several chunks, a partial last chunk, one chunk
        y = ChunkedScan(chunk, p, g, n)(x, dt, A, Bm, Cm, D, dt_bias)
        assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-4), chunk


def test_parameters_are_mamba_mixers(tp1):
    assert {k: v for k, v in tp1.parameters.items() if k.startswith("decoder.layers.0.")} == {
        "decoder.layers.0.norm.weight": (H,),
        f"{MIXER}.in_proj.weight": (IN_PROJ, H),
        f"{MIXER}.conv1d.weight": (CONV, 1, D_CONV),
        f"{MIXER}.conv1d.bias": (CONV,),
        f"{MIXER}.dt_bias": (HEADS,),
        f"{MIXER}.A_log": (HEADS,),
        f"{MIXER}.D": (HEADS,),
        f"{MIXER}.norm.weight": (D_INNER,),
        f"{MIXER}.out_proj.weight": (H, D_INNER),
    }
    mamba = mamba_layer_parameters(H, D_INNER, HEADS, GROUPS, STATE)
    attention = H + 3 * H * H + H * H  # norm, QKV, projection
    mlp = H + 2 * H * FFN  # norm, fc1, fc2 (squared ReLU: not gated)
    assert tp1.numel("decoder.layers.0.") == mamba == 30_896
    assert tp1.numel() == mamba + attention + mlp + 2 * VOCAB * H + H  # untied embedding and output, final norm


def test_the_mixer_runs_the_projections_the_depthwise_conv_and_the_ssd_matmuls(tp1):
    c, hg = S // CHUNK, HEADS // GROUPS
    assert tp1.count(Phase.FORWARD, "aten.mm.default", MIXER) == Counter({
        ((T, H), (H, IN_PROJ)): 1, ((T, D_INNER), (D_INNER, H)): 1})
    assert tp1.count(Phase.FORWARD, "aten.convolution.default", MIXER) == Counter({
        ((B, CONV, S), (CONV, 1, D_CONV), (CONV,)): 1})
    bmm = tp1.count(Phase.FORWARD, "aten.bmm.default", MIXER)
    assert bmm == Counter({
        ((B * c * GROUPS, CHUNK, STATE), (B * c * GROUPS, STATE, CHUNK)): 1,  # C Bᵀ per chunk and group
        ((B * c * HEADS, CHUNK, CHUNK), (B * c * HEADS, CHUNK, HEADDIM)): 1,  # intra-chunk output
        ((B * c * GROUPS, hg * HEADDIM, CHUNK), (B * c * GROUPS, CHUNK, STATE)): 1,  # chunk states
        ((B * HEADS, c + 1, c + 1), (B * HEADS, c + 1, HEADDIM * STATE)): 1,  # state passing
        ((B * c * GROUPS, CHUNK, STATE), (B * c * GROUPS, STATE, hg * HEADDIM)): 1,  # inter-chunk output
    })
    ssd_flops = sum(r.flops for r in tp1.ops(Phase.FORWARD, f"{MIXER}.ssd") if r.key.op == "aten.bmm.default")
    L = S  # tokens per sequence
    assert ssd_flops == 2 * B * (GROUPS * L * CHUNK * STATE  # C Bᵀ
                                 + HEADS * L * CHUNK * HEADDIM  # intra-chunk
                                 + 2 * HEADS * L * HEADDIM * STATE  # chunk states, inter-chunk output
                                 + HEADS * (c + 1) ** 2 * HEADDIM * STATE)  # state passing
    assert tp1.count(Phase.BACKWARD, "aten.convolution_backward.default", MIXER) == Counter({
        ((B, CONV, S + D_CONV - 1), (B, CONV, S), (CONV, 1, D_CONV)): 1})
    assert sum(tp1.count(Phase.BACKWARD, "aten.bmm.default", MIXER).values()) == 10  # both gradients of each
    assert sum(tp1.count(Phase.BACKWARD, "aten.mm.default", MIXER).values()) == 4


def test_one_hybrid_stack_records_every_layer_kind(tp1):
    counts = {layer: (len(tp1.ops(Phase.FORWARD, f"decoder.layers.{layer}.")),
                      len(tp1.ops(Phase.BACKWARD, f"decoder.layers.{layer}."))) for layer in range(3)}
    assert counts == {0: (82, 141), 1: (17, 32), 2: (12, 25)}
    assert not [c for c in tp1.collectives() if c.module.startswith("decoder.")]  # TP 1: the loss's only
    assert tp1.ops(Phase.FORWARD, "output_layer") and tp1.ops(Phase.BACKWARD, "embedding")


def test_tensor_parallel_splits_the_mixer_by_heads_and_groups():
    tp = 2
    recorded = run(tp)
    assert recorded.parameters[f"{MIXER}.in_proj.weight"] == (IN_PROJ // tp, H)
    assert recorded.parameters[f"{MIXER}.conv1d.weight"] == (CONV // tp, 1, D_CONV)
    assert recorded.parameters[f"{MIXER}.A_log"] == (HEADS // tp,)
    assert recorded.parameters[f"{MIXER}.norm.weight"] == (D_INNER // tp,)
    assert recorded.parameters[f"{MIXER}.out_proj.weight"] == (H, D_INNER // tp)
    full = T * H * 2  # bf16 hidden states of the whole sequence
    mixer = Counter((c.phase, c.kind, c.nbytes, c.module) for c in recorded.collectives() if c.module.startswith(MIXER))
    assert mixer == Counter({
        (Phase.FORWARD, K.ALL_GATHER, full, f"{MIXER}.in_proj"): 1,  # sequence parallel in
        (Phase.FORWARD, K.REDUCE_SCATTER, full, f"{MIXER}.out_proj"): 1,  # and out
        (Phase.BACKWARD, K.ALL_GATHER, full, f"{MIXER}.out_proj"): 1,
        (Phase.BACKWARD, K.ALL_GATHER, full, f"{MIXER}.in_proj"): 1,
        (Phase.BACKWARD, K.REDUCE_SCATTER, full, f"{MIXER}.in_proj"): 1,
    })


def test_nemotron_h_56b_has_its_published_parameter_count():
    """Nemotron-H 56B (../shared/models/nemotronh_56b.sh), its TP 8 shard built by megatron-core on the
    fake world: every parameter counted once."""
    from megatron.core.models.mamba import MambaModel
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_adapters.fake_world import fake_world, quiet_megatron, reset_global_memory_buffer
    from megatron_adapters.stand_ins import hybrid_stack_spec

    pattern = "M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-"
    assert (len(pattern), pattern.count("M"), pattern.count("*"), pattern.count("-")) == (118, 54, 10, 54)
    tp, hidden, vocab = 8, 8192, 131072
    with quiet_megatron(), cpu_tracing_patches(), fake_world(ParallelPlan(tensor_parallel=tp, sequence_parallel=True)):
        reset_global_memory_buffer()
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = MambaModel(config(tp, len(pattern), hidden_size=hidden, num_attention_heads=64,
                                      num_query_groups=8, kv_channels=128, ffn_hidden_size=32768, mamba_state_dim=256,
                                      mamba_head_dim=64, mamba_num_groups=8),
                               hybrid_stack_spec(), vocab_size=vocab, max_sequence_length=8192,
                               hybrid_override_pattern=pattern, position_embedding_type="none")
            per_rank = sum(p.numel() for p in model.parameters())
        reset_global_memory_buffer()
    d_inner, heads, groups, state, kv, ffn = 16384, 256, 8, 256, 2 * 8 * 128, 32768
    mamba = mamba_layer_parameters(hidden, d_inner, heads, groups, state)
    attention = hidden + hidden * (hidden + kv) + hidden * hidden
    mlp = hidden + 2 * hidden * ffn
    total = 54 * mamba + 10 * attention + 54 * mlp + 2 * vocab * hidden + hidden
    assert total == 56_324_350_464
    # the shard: everything split over the 8 ranks but the 118 layer norms and the final norm
    norms = (len(pattern) + 1) * hidden
    assert per_rank == (total - norms) // tp + norms
    assert round(total / 1e9) == 56  # "Nemotron-H-56B"


def test_the_mamba_stacks_final_norm_is_a_stand_in_only_while_tracing():
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.ssm import mamba_block

    with cpu_tracing_patches():
        assert mamba_block.TENorm is LocalNorm
    assert mamba_block.TENorm is TENorm


def test_a_moe_layer_in_the_pattern_routes_tokens_to_local_experts():
    """``E`` in the pattern: megatron-core's local MoE layer (the routing assumption of
    megatron_adapters.moe: balanced), after a Mamba layer."""
    from megatron.core.models.mamba import MambaModel

    from megatron_adapters.moe import LOAD_BALANCING, prepare_moe_layers
    from megatron_adapters.stand_ins import hybrid_stack_spec

    experts, topk, expert_ffn = 4, 2, 32

    def build():
        moe = dict(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
                   moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
                   moe_token_dispatcher_type="alltoall", **LOAD_BALANCING)
        model = MambaModel(config(layers=2, **moe), hybrid_stack_spec(num_experts=experts, mamba_chunk_size=CHUNK),
                           vocab_size=VOCAB, max_sequence_length=S, hybrid_override_pattern="ME",
                           position_embedding_type="none")
        prepare_moe_layers(model, 1.0)
        return model

    def inputs():
        tokens = torch.zeros(B, S, dtype=torch.long)
        return tokens, None, torch.ones(1, 1, S, S, dtype=torch.bool), tokens

    recorded = record(build, inputs, call=lambda model, a: model(a[0], a[1], a[2], labels=a[3]))
    moe = "decoder.layers.1."
    assert recorded.numel(moe) == H + experts * H + experts * 2 * H * expert_ffn  # norm, router, experts
    per_expert = T * topk // experts
    assert recorded.count(Phase.FORWARD, "aten.mm.default", moe) == Counter({
        ((T, H), (H, experts)): 1,  # router
        ((per_expert, H), (H, expert_ffn)): experts, ((per_expert, expert_ffn), (expert_ffn, H)): experts})
