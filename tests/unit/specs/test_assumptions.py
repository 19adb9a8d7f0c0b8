"""Every feature that is costed by a stand-in or a modelled kernel says so in the estimate's
assumptions, and a plain dense model assumes nothing."""

from vtrain_plugin.specs.assumptions import assumptions
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

PLAN = ParallelPlan()
LLAMA = dict(family="llama", num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)


def test_a_dense_model_assumes_nothing():
    assert assumptions(ModelSpec(**LLAMA), PLAN) == ()
    assert assumptions(None, PLAN) == ()


def test_each_attention_variant_names_what_it_assumes():
    mla = ModelSpec(**LLAMA, multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16, qk_head_dim=8,
                    qk_pos_emb_head_dim=8, v_head_dim=8)
    assert [line.split(" ")[0] for line in assumptions(mla, PLAN)] == ["MLA"]
    windowed = ModelSpec(**LLAMA, window_size=(8, 0), window_attn_skip_freq=2, softmax_type="learnable",
                         mtp_num_layers=1)
    lines = assumptions(windowed, PLAN)
    assert [line.split(":")[0] for line in lines] == ["sliding window 8 tokens back", "attention sinks",
                                                      "multi-token prediction"]


def test_a_hybrid_says_its_mixer_is_a_stand_in():
    hybrid = ModelSpec(num_layers=3, hidden_size=256, num_attention_heads=4, seq_length=256,
                       hybrid_layer_pattern="M*-")
    (line,) = assumptions(hybrid, PLAN)
    assert line.startswith("Mamba-2 mixer traced through a stand-in") and "never measured" in line
