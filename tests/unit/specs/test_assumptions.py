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


def test_flex_and_ep_overlap_state_their_constants():
    from vtrain_plugin.specs.parallel import ParallelPlan
    moe = ModelSpec(**LLAMA, num_experts=8)
    plan = ParallelPlan(data_parallel=4, expert_parallel=4, moe_token_dispatcher="flex",
                        overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    lines = [line for line in assumptions(moe, plan) if "flex" in line or "EP all-to-all" in line]
    assert len(lines) == 2
    assert "not validated on other GPUs" in lines[0] and "20 SMs" in lines[1] and "weight gradients" in lines[1]
    assert not [line for line in assumptions(moe, ParallelPlan(data_parallel=4, expert_parallel=4))
                if "flex" in line or "EP all-to-all" in line]
