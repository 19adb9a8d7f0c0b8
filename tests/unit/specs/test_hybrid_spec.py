"""A Mamba hybrid's description: its pattern and Mamba dims checked in one line, its pipeline split,
and Megatron-LM's hybrid flags (pretrain_mamba.py) read into the same ModelSpec."""

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.hybrid import allocate_pattern, stage_patterns
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

DIMS = dict(hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=1000)


def hybrid(pattern: str = "M*-M-M", **fields) -> ModelSpec:
    return ModelSpec(num_layers=fields.pop("num_layers", len(pattern)), hybrid_layer_pattern=pattern,
                     **{**DIMS, **fields})


@pytest.mark.parametrize("fields, message", [
    (dict(pattern="M*X"), "model.hybrid_layer_pattern: 'X' is not a layer letter (M Mamba, * attention, - MLP, "
                          "E MoE), in 'M*X'"),
    (dict(pattern="ME"), "model.num_experts and a MoE layer (E) in model.hybrid_layer_pattern go together: the "
                         "pattern places a hybrid's MoE layers, num_experts sizes them"),
    (dict(pattern="M*", num_experts=4), "model.num_experts and a MoE layer (E) in model.hybrid_layer_pattern go "
                                        "together: the pattern places a hybrid's MoE layers, num_experts sizes them"),
    (dict(pattern="M*E", num_experts=4, moe_layer_freq=2),
     "model.moe_layer_freq with model.hybrid_layer_pattern: a hybrid's MoE layers are its pattern's E layers"),
    (dict(pattern="M*-", num_layers=4), "model.hybrid_layer_pattern has 3 layers, model.num_layers is 4: one letter "
                                        "per layer"),
    (dict(mamba_head_dim=48), "model.mamba_head_dim (48) must divide the Mamba inner width 2 x model.hidden_size "
                              "(512)"),
    (dict(mamba_num_groups=3), "model.mamba_num_groups (3) must divide the Mamba heads (8)"),
    (dict(mamba_state_dim=0), "model.mamba_state_dim must be positive, got 0"),
])
def test_hybrid_fields_are_checked_in_one_line(fields, message):
    with pytest.raises(ConfigError) as exc:
        hybrid(fields.pop("pattern", "M*-M-M"), **fields)
    assert str(exc.value) == message


def test_mamba_fields_need_a_pattern_and_default_to_megatron_cores():
    with pytest.raises(ConfigError, match=r"^model.mamba_state_dim needs model.hybrid_layer_pattern \(a Mamba hybrid\)$"):
        ModelSpec(num_layers=2, mamba_state_dim=16, **DIMS)
    model = hybrid()
    assert (model.mamba_state, model.mamba_headdim, model.mamba_groups, model.mamba_heads) == (128, 64, 8, 8)
    assert hybrid(mamba_num_heads=4, mamba_num_groups=2).mamba_d_inner == 4 * 64


@pytest.mark.parametrize("plan, message", [
    (ParallelPlan(pipeline_parallel=2, virtual_pipeline=3), "virtual_pipeline (3) must be 1 for a Mamba hybrid: "
                                                            "megatron-core's MambaStack builds no interleaved pipeline"),
    (ParallelPlan(context_parallel=2), "context_parallel (2) in a Mamba hybrid: context parallelism of the Mamba "
                                       "mixer is not modelled by vtrain yet"),
    (ParallelPlan(tensor_parallel=16, data_parallel=1), "tensor_parallel_size (16) must divide the Mamba heads (8)"),
])
def test_layouts_megatron_core_cannot_build_for_a_hybrid_are_refused(plan, message):
    model = hybrid("M*-M-M", num_attention_heads=16, mamba_num_groups=8) if plan.tensor_parallel == 16 else \
        hybrid("M*-M-M" * 2, mamba_num_groups=8)
    with pytest.raises(ConfigError) as exc:
        plan.check_fits(model)
    assert str(exc.value) == message


def test_each_pipeline_rank_holds_its_contiguous_slice_of_the_pattern():
    model = hybrid("M*-M-M-M*-M")
    assert stage_patterns(ParallelPlan(pipeline_parallel=2), hybrid("M*-M-M-M*-M-")) == ("M*-M-M", "-M*-M-")
    assert stage_patterns(ParallelPlan(pipeline_parallel=3, decoder_first_pipeline_num_layers=3), model) == (
        "M*-", "M-M-", "M*-M")


def test_the_ratios_allocate_the_pattern_megatron_core_allocates():
    from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

    for layers, attention, mlp in ((8, 0.0, 0.0), (24, 0.08, 0.5), (52, 0.1, 0.45), (7, 0.3, 0.3), (118, 0.085, 0.46)):
        assert allocate_pattern(layers, attention, mlp) == "".join(allocate_layers(layers, attention, mlp))


FLAGS = ("--hidden-size 256 --num-attention-heads 4 --seq-length 256 --micro-batch-size 1 --vocab-size 1000 "
         "--mamba-state-dim 16 --mamba-head-dim 32 --mamba-num-groups 2")


def mamba_plan(flags: str, script: str = "pretrain_mamba.py"):
    return megatron_plan(read_command_line(f"torchrun --nproc_per_node 4 {script} {FLAGS} {flags}"))


def test_pretrain_mamba_reads_the_pattern_in_either_spelling_or_allocates_it():
    newer = mamba_plan("--hybrid-layer-pattern 'M*-M-M'").model
    assert newer == mamba_plan("--hybrid-override-pattern 'M*-M-M' --num-layers 6").model
    assert (newer.num_layers, newer.hybrid_layer_pattern, newer.mamba_state, newer.mamba_headdim,
            newer.mamba_groups) == (6, "M*-M-M", 16, 32, 2)
    assert mamba_plan("--num-layers 8").model.hybrid_layer_pattern == "MMMMMMMM"  # no ratio: all Mamba
    assert mamba_plan("--num-layers 10 --hybrid-attention-ratio 0.2 --hybrid-mlp-ratio 0.4").model \
        .hybrid_layer_pattern == allocate_pattern(10, 0.2, 0.4)


def test_pretrain_mamba_reads_moe_layers_and_their_experts():
    model = mamba_plan("--hybrid-layer-pattern 'M*EM-E' --num-experts 4 --moe-router-topk 2 "
                       "--moe-ffn-hidden-size 128").model
    assert (model.hybrid_layer_pattern, model.num_experts, model.router_topk, model.expert_ffn_size) == \
        ("M*EM-E", 4, 2, 128)
    assert model.moe_layer_pattern == (False, False, True, False, False, True) and model.num_moe_layers == 2


@pytest.mark.parametrize("flags, script, message", [
    ("--hybrid-layer-pattern M*-", "pretrain_gpt.py", "--hybrid-layer-pattern with pretrain_gpt.py: a Mamba hybrid is "
                                                      "trained by pretrain_mamba.py (pretrain_gpt.py builds a GPT and "
                                                      "ignores it)"),
    ("--hybrid-layer-pattern M*- --num-layers 4", "pretrain_mamba.py", "--hybrid-layer-pattern has 3 layers, "
                                                                       "--num-layers is 4: one letter per layer"),
    ("--hybrid-layer-pattern 'M*|M*'", "pretrain_mamba.py", "--hybrid-layer-pattern: '|' is not a layer letter (M "
                                                            "Mamba, * attention, - MLP, E MoE), in 'M*|M*'"),
    ("--num-layers 4 --disable-mamba-mem-eff-path", "pretrain_mamba.py", "--disable-mamba-mem-eff-path: the unfused "
                                                                         "Mamba path (causal_conv1d and "
                                                                         "mamba_chunk_scan_combined apart) is not "
                                                                         "modelled by vtrain yet"),
    ("--hybrid-layer-pattern M*--- --hybrid-attention-ratio 0.5", "pretrain_mamba.py",
     "--hybrid-layer-pattern must have as many layers of each kind as --hybrid-attention-ratio and --hybrid-mlp-ratio "
     "allocate (megatron-core checks it)"),
])
def test_hybrid_flags_megatron_would_not_build_are_refused_in_one_line(flags, script, message):
    with pytest.raises(ConfigError) as exc:
        mamba_plan(flags, script)
    assert str(exc.value) == message
