"""MoE features beyond the routed experts, traced from megatron-core's own MoELayer: shared experts
(and their overlap), dense and MoE layers mixed, grouped-GEMM experts, router variants, sinkhorn
routing, capacity factor and token dropping; each on the traced graph and as the direction it moves
the estimate."""

from collections import Counter
from dataclasses import replace

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.core.graph import CollectiveKind, CollectiveNode, OpNode, ParallelGroup, Phase
from vtrain_plugin.core.units import GIB
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify
from vtrain_plugin.cost.lowering.megatron_core_te import GROUPED_GEMM
from vtrain_plugin.cost.lowering.stacks import map_nodes
from vtrain_plugin.cost.workspaces import TE_CUBLAS_HOPPER_NBYTES, TE_CUBLAS_STREAMS
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import SINKHORN_ITERATIONS, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

# Sizes cost nothing to trace (fake tensors) and make the GPU, not the host, set the pace (with the
# joint fit's host costs, a 4,096-token micro-batch of this model is bound by the host).
H, S, E, TOPK, FFN, SHARED, TP, EP = 3584, 16384, 8, 2, 2048, 2560, 2, 2
BASE = ModelSpec(name="moe-features", family="llama", num_layers=2, hidden_size=H, num_attention_heads=28,
                 seq_length=S, vocab_size=8192, dtype="bf16", num_experts=E, moe_router_topk=TOPK,
                 moe_ffn_hidden_size=FFN)
# TP 2 with SP, EP 2 and expert TP 2 over the 4 TP x DP ranks: 4 local experts, alltoall dispatcher.
PLAN = ParallelPlan(tensor_parallel=TP, sequence_parallel=True, data_parallel=2, expert_parallel=EP,
                    moe_token_dispatcher="alltoall")
LOCAL = E // EP
PER_RANK = S // TP * TOPK // E  # balanced token-expert pairs one rank routes to each expert: 2,048
SOURCES = TP * EP  # ranks of expert TP x EP sending to each local expert
CLUSTER = get_cluster_preset("dgx-h100")
TRAINING = TrainingSpec(global_batch_size=8)


def traced(**fields):
    return trace(replace(BASE, **fields), PLAN)


def estimated(**fields):
    return estimate(traced(**fields), cluster=CLUSTER, training=TRAINING, profile_db=False)


def gemms(layer, phase, module):
    return Counter(op.key.input_shapes for op in layer.ops(phase) if op.op == "aten.mm.default" and module in op.module)


@pytest.fixture(scope="module")
def base():
    return traced()


@pytest.fixture(scope="module")
def shared():
    return traced(moe_shared_expert_intermediate_size=SHARED)


# -- shared experts -------------------------------------------------------------------------------

def test_shared_expert_is_megatrons_shared_expert_mlp(base, shared):
    layer = shared.stages[0].layer_template()
    # SharedExpertMLP: a tensor-parallel SwiGLU MLP over every token of the sequence (gathered from SP)
    assert gemms(layer, Phase.FORWARD, ".mlp.shared_experts.") == Counter({
        ((S, H), (H, 2 * SHARED // TP)): 1, ((S, SHARED // TP), (SHARED // TP, H)): 1})
    assert gemms(layer, Phase.BACKWARD, ".mlp.shared_experts.") == Counter({
        ((S, H), (H, SHARED // TP)): 1, ((H, S), (S, SHARED // TP)): 1,
        ((S, 2 * SHARED // TP), (2 * SHARED // TP, H)): 1, ((2 * SHARED // TP, S), (S, H)): 1})
    assert layer.num_parameters - base.stages[0].layer_template().num_parameters == 3 * H * SHARED // TP


def test_shared_expert_adds_time_and_memory(base, shared):
    without, with_shared = (estimate(g, cluster=CLUSTER, training=TRAINING, profile_db=False) for g in (base, shared))
    assert with_shared.breakdown_ms["forward"] > without.breakdown_ms["forward"]
    assert with_shared.iteration_time_ms > without.iteration_time_ms
    assert with_shared.memory_gib[0].weights_gib > without.memory_gib[0].weights_gib


def test_shared_expert_overlap_hides_the_token_all_to_alls(shared):
    plain = estimate(shared, cluster=CLUSTER, training=TRAINING, profile_db=False)
    overlapped = estimated(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_overlap=True)
    assert overlapped.breakdown_ms["ep_comm"] < plain.breakdown_ms["ep_comm"]
    assert overlapped.iteration_time_ms < plain.iteration_time_ms
    assert overlapped.memory_gib == plain.memory_gib
    assert any("shared expert overlap" in line for line in overlapped.assumptions)


def test_shared_expert_overlap_needs_the_alltoall_dispatcher():
    from vtrain_plugin.core.errors import ConfigError

    model = replace(BASE, moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_overlap=True)
    with pytest.raises(ConfigError, match="model.moe_shared_expert_overlap needs parallel.moe_token_dispatcher "
                                          "alltoall"):
        trace(model, replace(PLAN, moe_token_dispatcher="allgather"))


# -- dense and MoE layers mixed ---------------------------------------------------------------------

MIXED = replace(BASE, num_layers=6, moe_layer_freq=(0, 0, 0, 1, 1, 1))
PP3 = replace(PLAN, pipeline_parallel=3)


@pytest.fixture(scope="module")
def mixed():
    return trace(MIXED, PP3)


def _is_moe(block) -> bool:
    return any(".mlp.router" in op.module for op in block.ops(Phase.FORWARD))


def test_each_stage_counts_its_dense_and_moe_layers(mixed):
    kinds = [[("moe" if _is_moe(b) else "dense", b.count) for b in s.blocks if b.kind.value == "layer"]
             for s in mixed.stages]
    assert kinds == [[("dense", 2)], [("dense", 1), ("moe", 1)], [("moe", 2)]]
    dense = mixed.stages[0].layer_template()
    f = MIXED.ffn_size  # the dense layers' MLP: the model's FFN, not the experts'
    assert gemms(dense, Phase.FORWARD, ".mlp.linear_fc") == Counter({((S, H), (H, 2 * f // TP)): 1,
                                                                     ((S, f // TP), (f // TP, H)): 1})
    assert not any(c.kind is CollectiveKind.ALL_TO_ALL for c in dense.collectives())


def test_dense_first_layers_change_the_time_and_memory_of_their_stages(mixed):
    every_moe = estimate(trace(replace(MIXED, moe_layer_freq=1), PP3), cluster=CLUSTER, training=TRAINING,
                         profile_db=False)
    first_dense = estimate(mixed, cluster=CLUSTER, training=TRAINING, profile_db=False)
    stages = lambda est, part: [s[part] for s in est.stage_breakdown_ms]  # noqa: E731
    assert stages(first_dense, "ep_comm")[0] == 0 < stages(every_moe, "ep_comm")[0]
    assert 0 < stages(first_dense, "ep_comm")[1] < stages(every_moe, "ep_comm")[1]
    assert stages(first_dense, "forward")[2] == stages(every_moe, "forward")[2]  # both two MoE layers and the head
    assert stages(first_dense, "forward")[0] != stages(every_moe, "forward")[0]
    assert first_dense.memory_gib[2] == every_moe.memory_gib[2]
    assert first_dense.memory_gib[0] != every_moe.memory_gib[0]


# -- grouped-GEMM experts ---------------------------------------------------------------------------

def _expert_gemms(nodes, phase):
    return [n for n in nodes if isinstance(n, OpNode) and n.phase is phase and ".mlp.experts" in n.module
            and classify(n.op) is OpClass.GEMM]


def test_grouped_gemm_is_one_kernel_with_the_flops_of_the_expert_gemms(base):
    layer = base.stages[0].layer_template()
    per_expert = map_nodes(layer.nodes, "megatron_core_te")
    grouped = map_nodes(layer.nodes, "megatron_core_te", grouped_experts=True)
    for phase, per_linear in ((Phase.FORWARD, 2), (Phase.BACKWARD, 4)):  # fc1, fc2; and dgrad, wgrad of each
        separate, together = _expert_gemms(per_expert, phase), _expert_gemms(grouped, phase)
        assert len(separate) == LOCAL * per_linear and len(together) == per_linear
        assert {n.op for n in together} == {GROUPED_GEMM}
        flops = lambda n: 2 * n.key.input_shapes[0][0] * n.key.input_shapes[0][1] * n.key.input_shapes[1][1]  # noqa
        assert sum(n.flops for n in together) == sum(flops(n) for n in separate)
        assert sum(n.nbytes for n in together) == sum(n.nbytes for n in separate)
    rows = SOURCES * PER_RANK
    fc1 = next(n for n in _expert_gemms(grouped, Phase.FORWARD) if n.module.endswith(".mlp.experts.linear_fc1"))
    assert fc1.key.input_shapes == ((LOCAL, rows, H), (LOCAL, H, 2 * FFN // TP))  # a batch of the local experts
    cats = [n for n in grouped if isinstance(n, OpNode) and n.module.endswith(".mlp.experts") and "cat" in n.op]
    assert cats == []  # one output tensor: SequentialMLP's concatenation is gone


def test_grouped_gemm_is_faster_than_separate_experts_and_keeps_the_flops(base):
    separate = estimate(base, cluster=CLUSTER, training=TRAINING, profile_db=False)
    grouped = estimated(moe_grouped_gemm=True)
    assert grouped.breakdown_ms["forward"] < separate.breakdown_ms["forward"]
    assert grouped.breakdown_ms["backward"] < separate.breakdown_ms["backward"]
    assert grouped.tflops_per_gpu * grouped.iteration_time_ms == pytest.approx(
        separate.tflops_per_gpu * separate.iteration_time_ms, rel=1e-9)
    # the same tensors; TransformerEngine's grouped GEMM adds its four multi-stream cuBLAS workspaces
    (g,), (s,) = grouped.memory_gib, separate.memory_gib
    assert replace(g, workspaces_gib=s.workspaces_gib) == s
    assert (g.workspaces_gib - s.workspaces_gib) * GIB == TE_CUBLAS_STREAMS * TE_CUBLAS_HOPPER_NBYTES


# -- router variants --------------------------------------------------------------------------------

def _router_ops(graph):
    return Counter(op.op.split(".")[1] for op in graph.stages[0].layer_template().ops(Phase.FORWARD)
                   if op.module.endswith(".mlp.router"))


def test_router_variants_are_traced_as_megatrons_top_k_router_runs_them(base):
    softmax = _router_ops(base)
    sigmoid = traced(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
    variant = _router_ops(sigmoid)
    assert "sigmoid" in variant and "sigmoid" not in softmax
    assert variant["topk"] == softmax["topk"] + 2  # the groups' top-2 scores, then the top groups
    assert gemms(sigmoid.stages[0].layer_template(), Phase.FORWARD, ".mlp.router") == \
        gemms(base.stages[0].layer_template(), Phase.FORWARD, ".mlp.router")  # small kernels only


def test_sinkhorn_routing_runs_its_iterations_in_the_router(base):
    aux, sinkhorn = _router_ops(base), _router_ops(traced(moe_router_load_balancing_type="sinkhorn"))
    assert "exp" not in aux and "gt" not in aux
    # megatron-core's sinkhorn: one exponential, then per iteration two scaled sums and their
    # reciprocals, the mean change and its check against the tolerance
    assert sinkhorn["exp"] == 1 and sinkhorn["gt"] == sinkhorn["mean"] == SINKHORN_ITERATIONS
    assert sinkhorn["reciprocal"] == 2 * SINKHORN_ITERATIONS
    assert sinkhorn["topk"] == 1 and aux["topk"] == 2  # the sinkhorn scores' top-k; the aux loss's top-k too


def test_sinkhorn_routing_adds_forward_time_and_names_its_assumption(base):
    aux = estimate(base, cluster=CLUSTER, training=TRAINING, profile_db=False)
    sinkhorn = estimated(moe_router_load_balancing_type="sinkhorn")
    assert sinkhorn.breakdown_ms["forward"] > aux.breakdown_ms["forward"]
    assert any(f"sinkhorn: {SINKHORN_ITERATIONS} iterations" in line for line in sinkhorn.assumptions)
    assert not any("sinkhorn" in line for line in aux.assumptions)


def test_sinkhorn_reads_alike_on_every_path_and_other_losses_stay_the_traced_aux_loss():
    sinkhorn = dict(moe_router_load_balancing_type="sinkhorn")
    models = read_on_every_path(sinkhorn, "--moe-router-load-balancing-type sinkhorn", moe_aux_loss_coeff=0.0)
    assert models == [replace(ModelSpec(**COMMON, **sinkhorn), tied_embeddings=None)] * 3
    (from_config, *_) = read_on_every_path({}, "", moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                           moe_aux_loss_coeff=[1e-2, 1e-3])
    assert from_config == replace(ModelSpec(**COMMON), tied_embeddings=None)


# -- the router's dtype, pre-softmax and per-sequence loss --------------------------------------------

def _router_keys(graph, op):
    return [o.key for o in graph.stages[0].layer_template().ops(Phase.FORWARD)
            if o.module.endswith(".mlp.router") and o.op == f"aten.{op}.default"]


def test_router_dtype_fp32_runs_the_gating_gemm_and_scores_in_fp32(base):
    fp32 = traced(moe_router_dtype="fp32")
    assert [k.dtypes for k in _router_keys(base, "mm")] == [("bfloat16", "bfloat16")]
    assert [k.dtypes for k in _router_keys(fp32, "mm")] == [("float32", "float32")]
    # the input and the weight cast up for the GEMM; the top-k probabilities and the aux loss's scores
    # no longer cast up (and back); the routing maps cast from fp32 scores
    casts = lambda g: Counter((k.input_shapes[0], k.dtypes[0], dict(k.args).get("dtype"))  # noqa: E731
                              for k in _router_keys(g, "_to_copy"))
    added, removed = casts(fp32) - casts(base), casts(base) - casts(fp32)
    assert added == Counter({((S // TP, H), "bfloat16", "float32"): 1, ((E, H), "bfloat16", "float32"): 1,
                             ((S // TP, E), "float32", "int32"): 2})
    assert removed == Counter({((S // TP, TOPK), "bfloat16", "float32"): 1, ((S // TP, TOPK), "float32", "bfloat16"): 1,
                               ((S // TP, E), "bfloat16", "float32"): 1, ((S // TP, E), "bfloat16", "int32"): 2})
    assert {k.dtypes for k in _router_keys(fp32, "topk")} == {("float32",)}


def test_router_pre_softmax_takes_the_softmax_over_every_expert_before_the_top_k(base):
    pre = traced(moe_router_pre_softmax=True)
    # the routing softmax (the aux loss's own is over every expert either way)
    assert sorted(k.input_shapes for k in _router_keys(base, "_softmax")) == [((S // TP, TOPK),), ((S // TP, E),)]
    assert [k.input_shapes for k in _router_keys(pre, "_softmax")] == [((S // TP, E),)] * 2
    assert _router_ops(pre) == _router_ops(base)  # the same kernels, the softmax wider


def _router_collectives(graph):
    return [(n.kind, n.group, n.nbytes) for n in graph.stages[0].layer_template().nodes
            if isinstance(n, CollectiveNode) and n.module.endswith(".mlp.router")]


def test_seq_aux_loss_adds_the_per_sequence_loss_kernels(base):
    seq = traced(moe_router_load_balancing_type="seq_aux_loss")
    assert _router_ops(seq) - _router_ops(base) == Counter({"div": 1})
    assert _router_ops(base) - _router_ops(seq) == Counter()
    assert _router_collectives(seq) == _router_collectives(base) == [(CollectiveKind.ALL_REDUCE, ParallelGroup.TP, 8 * E)]


def test_global_aux_loss_sums_the_expert_counts_over_every_rank_of_the_stage(base):
    glob = traced(moe_router_load_balancing_type="global_aux_loss")
    assert _router_collectives(glob) == [(CollectiveKind.ALL_REDUCE, ParallelGroup.TP_DP_CP, 8 * E)]
    # the running count over the global batch and its average
    assert _router_ops(glob) - _router_ops(base) == Counter({"add_": 2, "div": 1})
    assert not (_router_ops(base) - _router_ops(glob))


def test_router_flags_read_alike_on_every_path():
    for loss in ("seq_aux_loss", "global_aux_loss"):
        router = dict(moe_router_dtype="fp32", moe_router_pre_softmax=True, moe_router_load_balancing_type=loss)
        models = read_on_every_path(router, f"--moe-router-dtype fp32 --moe-router-pre-softmax "
                                            f"--moe-router-load-balancing-type {loss}")
        assert models == [replace(ModelSpec(**COMMON, **router), tied_embeddings=None)] * 3


# -- capacity factor and token dropping -------------------------------------------------------------

def _expert_fc1_rows(graph):
    return {shapes[0][0] for shapes in gemms(graph.stages[0].layer_template(), Phase.FORWARD, ".local_experts.")
            if shapes[1][0] == H}


def test_each_expert_computes_min_of_its_share_and_the_capacity(base):
    assert PER_RANK == 2048 and _expert_fc1_rows(base) == {SOURCES * PER_RANK}  # dropless
    dropping = traced(moe_expert_capacity_factor=0.5)
    assert _expert_fc1_rows(dropping) == {SOURCES * 1024}  # capacity ceil(2048 x 0.5), below the share
    padded = traced(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)
    assert _expert_fc1_rows(padded) == {SOURCES * 3072}  # padded to ceil(2048 x 1.5)
    assert _expert_fc1_rows(traced(moe_expert_capacity_factor=1.5)) == {SOURCES * PER_RANK}  # nothing to drop


def test_a_capacity_below_the_share_removes_work_and_padding_adds_it(base):
    dropless = estimate(base, cluster=CLUSTER, training=TRAINING, profile_db=False)
    dropping = estimated(moe_expert_capacity_factor=0.5)
    padded = estimated(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)
    assert dropping.iteration_time_ms < dropless.iteration_time_ms < padded.iteration_time_ms
    work = lambda est: est.hardware_tflops_per_gpu * est.iteration_time_ms  # noqa: E731  (FLOPs per GPU)
    assert work(dropping) < work(dropless) < work(padded)
    assert dropping.breakdown_ms["ep_comm"] < dropless.breakdown_ms["ep_comm"] < padded.breakdown_ms["ep_comm"]
    assert any("capacity factor 0.5" in line for line in dropping.assumptions)


# -- one answer on every input path -----------------------------------------------------------------

FEATURES = dict(moe_shared_expert_intermediate_size=1024, moe_shared_expert_overlap=True, moe_layer_freq=(0, 1, 1, 1),
                moe_grouped_gemm=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True,
                moe_token_drop_policy="position")


COMMON = dict(family="llama", num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=8,
              ffn_hidden_size=1536, seq_length=256, vocab_size=1024, dtype="bf16", num_experts=8,
              moe_router_topk=2, moe_ffn_hidden_size=256)
COMMON_FLAGS = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 1536 --seq-length 256 "
                "--vocab-size 1024 --bf16 --swiglu --normalization RMSNorm --disable-bias-linear "
                "--group-query-attention --num-query-groups 8 "
                "--position-embedding-type rope --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 1 "
                "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 "
                "--moe-token-dispatcher-type alltoall")


def read_on_every_path(features: dict, flags: str, **config_fields) -> list[ModelSpec]:
    """The model of COMMON with ``features`` from a TransformerConfig (with ``config_fields``), a plan
    file and Megatron-LM flags (COMMON_FLAGS with ``flags``), each spelled as the path spells it."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adapters.config_map import model_spec_from_transformer_config
    from vtrain_plugin.specs.megatron.args import megatron_plan
    from vtrain_plugin.specs.megatron.launch_script import read_command_line
    from vtrain_plugin.specs.plan_file import parse_plan

    config = TransformerConfig(
        num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1536, bf16=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=256, moe_token_dispatcher_type="alltoall",
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in features.items()}, **config_fields)
    from_config = model_spec_from_transformer_config(config, vocab_size=1024, seq_length=256)
    plan_file = parse_plan({"model": {**COMMON, **{k: (list(v) if isinstance(v, tuple) else v)
                                                   for k, v in features.items()}},
                            "parallel": {"moe_token_dispatcher": "alltoall"}, "training": {"global_batch_size": 8}})
    read = megatron_plan(read_command_line(f"{COMMON_FLAGS} {flags}"), gpus=1)
    assert read.warning is None
    return [replace(from_config, tied_embeddings=None), replace(plan_file.model, tied_embeddings=None),
            replace(read.model, tied_embeddings=None)]


def test_the_moe_features_read_alike_from_flags_a_transformer_config_and_a_plan_file():
    flags = ("--moe-shared-expert-intermediate-size 1024 "
             "--moe-shared-expert-overlap --moe-layer-freq '([0]*1+[1]*3)' --moe-grouped-gemm "
             "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 "
             "--moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 --moe-expert-capacity-factor 1.25 "
             "--moe-pad-expert-input-to-capacity --moe-token-drop-policy position")
    expected = ModelSpec(**COMMON, **FEATURES)
    assert read_on_every_path(FEATURES, flags) == [replace(expected, tied_embeddings=None)] * 3


def test_the_cli_lists_the_assumptions_in_json_and_in_the_footer(tmp_path, run_cli):
    import json

    import yaml

    model = {k: v for k, v in replace(BASE, moe_expert_capacity_factor=0.5).to_dict().items() if v is not None}
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({"model": model, "parallel": {"tensor_parallel": 2, "sequence_parallel": True,
                                                                  "data_parallel": 2, "expert_parallel": 2,
                                                                  "moe_token_dispatcher": "alltoall"},
                                    "training": {"global_batch_size": 8}, "cluster": {"preset": "dgx-h100"}}))
    listed = json.loads(run_cli("estimate", str(path), "--format", "json", check=True).stdout)["assumptions"]
    assert listed[0].startswith("MoE routing balanced: every expert receives tokens x 2 / 8")
    assert listed[2] == ("MoE capacity factor 0.5 under balanced routing: each expert computes min(balanced share, "
                         "capacity) tokens")
    table = run_cli("estimate", str(path), check=True).stdout
    assert [line for line in table.splitlines() if line.startswith("assumed: ")] == [f"assumed: {a}" for a in listed]


def test_biased_experts_on_one_rank_are_traced_with_their_bias():
    """A biased SequentialMLP expert at TP = EP = 1 adds its bias in place after the row-parallel
    linear's (one-rank) all-reduce: traced as TransformerEngine's linear runs it, one bias add per
    expert weighted by the router's probabilities."""
    model = replace(BASE, hidden_size=256, num_attention_heads=4, seq_length=128, moe_ffn_hidden_size=512,
                    family="gpt", add_bias_linear=True)
    layer = trace(model, ParallelPlan()).stages[0].layer_template()
    adds = Counter(op.module for op in layer.ops(Phase.FORWARD)
                   if ".experts.local_experts." in op.module and op.op == "aten.add_.Tensor")
    assert sorted(adds.values()) == [1] * E
