"""Uneven pipeline splits: layers per (pipeline rank, virtual chunk) exactly as Megatron-Core builds them.

The reference is megatron-core's own ``get_num_layers_to_build`` on a ``TransformerConfig`` with the
same split (megatron-core 0.16 names Megatron-LM's ``--decoder-first-pipeline-num-layers``
``num_layers_in_first_pipeline_stage``), plus the 405B layout written out by hand.
"""

import pytest
import torch

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan


def model(layers: int, mtp: int | None = None) -> ModelSpec:
    return ModelSpec(family="llama", num_layers=layers, hidden_size=1024, num_attention_heads=8, seq_length=128,
                     mtp_num_layers=mtp)


def megatron_layers(layers: int, plan: ParallelPlan, mtp: int | None = None) -> list[list[int]]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    vp = plan.virtual_pipeline
    config = TransformerConfig(
        num_layers=layers, hidden_size=1024, num_attention_heads=8, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=plan.pipeline_parallel,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        num_layers_in_first_pipeline_stage=plan.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=plan.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=plan.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=plan.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=plan.pipeline_layout, mtp_num_layers=mtp)
    if plan.pipeline_layout is not None:  # megatron-core's own parse ([pp_rank][vp_rank]), read without a world
        from megatron.core.transformer.enums import LayerType

        return [[stage.count(LayerType.decoder) for stage in rank]
                for rank in config.pipeline_model_parallel_layout.layout]
    return [[get_num_layers_to_build(config, vp_stage=c if vp > 1 else None, pp_rank=r) for c in range(vp)]
            for r in range(plan.pipeline_parallel)]


LLAMA_405B = ParallelPlan(tensor_parallel=8, pipeline_parallel=8, virtual_pipeline=8,
                          account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)

RECIPES = [
    pytest.param(126, LLAMA_405B, id="llama3.1-405b pp8 vp8 embedding+loss"),
    pytest.param(96, ParallelPlan(pipeline_parallel=16, virtual_pipeline=3), id="even pp16 vp3"),
    pytest.param(30, ParallelPlan(pipeline_parallel=4, decoder_first_pipeline_num_layers=6,
                                  decoder_last_pipeline_num_layers=8), id="first 6 last 8"),
    pytest.param(62, ParallelPlan(pipeline_parallel=8, virtual_pipeline=2, decoder_first_pipeline_num_layers=6,
                                  decoder_last_pipeline_num_layers=8), id="first 6 last 8 vp2"),
    pytest.param(34, ParallelPlan(pipeline_parallel=4, decoder_last_pipeline_num_layers=4), id="last only"),
    pytest.param(31, ParallelPlan(pipeline_parallel=4, account_for_embedding_in_pipeline_split=True),
                 id="embedding only"),
    pytest.param(15, ParallelPlan(pipeline_parallel=4, virtual_pipeline=2, account_for_loss_in_pipeline_split=True),
                 id="loss only vp2"),
    pytest.param(6, ParallelPlan(pipeline_parallel=4, virtual_pipeline=2, account_for_embedding_in_pipeline_split=True,
                                 account_for_loss_in_pipeline_split=True), id="embedding-only and loss-only chunks"),
    # layouts (pipeline_layout): Kimi K2's as published, DeepSeek-V3's without its MTP slot, one uneven
    pytest.param(61, ParallelPlan(pipeline_parallel=16, virtual_pipeline=2, pipeline_layout="Et|(tt|)*30L"),
                 id="kimi-k2 layout pp16 vp2"),
    pytest.param(61, ParallelPlan(pipeline_parallel=8, virtual_pipeline=4, pipeline_layout="Et|(tt|)*30L"),
                 id="deepseek-v3 layout pp8 vp4 without mtp"),
    pytest.param(7, ParallelPlan(pipeline_parallel=4, pipeline_layout="Ett,t|t*2|t|tL"), id="uneven layout"),
    pytest.param(94, ParallelPlan(pipeline_parallel=8, virtual_pipeline=4, account_for_embedding_in_pipeline_split=True,
                                  account_for_loss_in_pipeline_split=True),
                 id="qwen3-235b pp8 vp4 with the remedy the refusal names"),
]


@pytest.mark.parametrize("layers,plan", RECIPES)
def test_layers_per_stage_and_chunk_are_megatron_cores(layers, plan):
    split = plan.chunk_layers(model(layers))
    assert [list(chunks) for chunks in split] == megatron_layers(layers, plan)
    assert sum(map(sum, split)) == layers


def test_llama_405b_split_written_out():
    split = LLAMA_405B.chunk_layers(model(126))
    assert split[0] == (1, 2, 2, 2, 2, 2, 2, 2)
    assert split[7] == (2, 2, 2, 2, 2, 2, 2, 1)
    assert all(split[r] == (2,) * 8 for r in range(1, 7))


def test_megatron_core_refuses_the_published_qwen3_235b_split():
    """The rule behind the refusal is megatron-core's: num_layers % pp, before the virtual stages."""
    with pytest.raises(AssertionError, match="num_layers should be divisible by pipeline_model_parallel_size"):
        megatron_layers(94, ParallelPlan(pipeline_parallel=8, virtual_pipeline=4))


def test_the_qwen3_235b_command_line_is_refused_with_the_remedy():
    """Megatron-LM flags as qwen3_235b_a22b.sh gives them: the same one line, the remedy's arithmetic last."""
    from vtrain_plugin.runs import run_config_from_megatron_args

    args = ("--num-layers 94 --hidden-size 4096 --num-attention-heads 64 --seq-length 4096 --vocab-size 151936 "
            "--pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 4 --micro-batch-size 1 "
            "--global-batch-size 64 --bf16")
    with pytest.raises(ConfigError) as err:
        run_config_from_megatron_args(args, gpus=8)
    assert str(err.value).startswith("pipeline_parallel_size (8) must divide num_layers (94): 94 = 8 x 11 + 6")
    assert "account_for_loss_in_pipeline_split: 94 + 2 = 96 = 8 x 4 x 3 layer slots" in str(err.value)


@pytest.mark.parametrize("layers,plan,message", [
    (126, ParallelPlan(pipeline_parallel=8),
     "pipeline_parallel_size (8) must divide num_layers (126): 126 = 8 x 15 + 6; with "
     "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split: 126 + 2 = 128 = 8 x 16 "
     "layer slots"),
    (126, ParallelPlan(pipeline_parallel=8, account_for_embedding_in_pipeline_split=True),
     "num_layers (126) + 1 (embedding) = 127 layer slots must be divisible by pipeline_parallel_size (8)"),
    (126, ParallelPlan(pipeline_parallel=8, virtual_pipeline=3, account_for_embedding_in_pipeline_split=True,
                       account_for_loss_in_pipeline_split=True),
     "the 16 layer slots of pipeline rank 0 must be divisible by virtual_pipeline (3)"),
    (31, ParallelPlan(pipeline_parallel=4, decoder_first_pipeline_num_layers=6, decoder_last_pipeline_num_layers=8),
     "num_layers (31) - decoder_first_pipeline_num_layers (6) - decoder_last_pipeline_num_layers (8) = 17 "
     "must be divisible by the 2 middle pipeline stages"),
    (12, ParallelPlan(pipeline_parallel=3, decoder_first_pipeline_num_layers=8, decoder_last_pipeline_num_layers=6),
     "num_layers (12) - decoder_first_pipeline_num_layers (8) - decoder_last_pipeline_num_layers (6) = -2 "
     "layers left for 1 middle pipeline stage(s)"),
    (14, ParallelPlan(pipeline_parallel=2, decoder_first_pipeline_num_layers=6, decoder_last_pipeline_num_layers=6),
     "num_layers (14) - decoder_first_pipeline_num_layers (6) - decoder_last_pipeline_num_layers (6) = 2 "
     "layers left for 0 middle pipeline stage(s)"),
    (30, ParallelPlan(pipeline_parallel=4, virtual_pipeline=2, decoder_first_pipeline_num_layers=5,
                      decoder_last_pipeline_num_layers=9),
     "the 5 layer slots of pipeline rank 0 must be divisible by virtual_pipeline (2)"),
    (96, ParallelPlan(pipeline_parallel=4, virtual_pipeline=5),
     "pipeline_parallel_size (4) * virtual_pipeline (5) = 20 must divide num_layers (96): the 24 layers of each "
     "pipeline rank over its 5 virtual stages; neither the embedding nor the loss as a layer slot makes it divide: "
     "set decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers or a pipeline_layout"),
    # Qwen3 235B-A22B as published (PP 8 x VP 4, no account-for flags): megatron-core's
    # get_num_layers_to_build asserts num_layers % pp before each rank's layers % vp
    (94, ParallelPlan(pipeline_parallel=8, virtual_pipeline=4),
     "pipeline_parallel_size (8) must divide num_layers (94): 94 = 8 x 11 + 6; with "
     "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split: 94 + 2 = 96 = 8 x 4 x 3 "
     "layer slots (megatron-core splits the layers over the pipeline ranks before each rank's over its 4 virtual "
     "stages)"),
])
def test_a_split_that_does_not_divide_shows_the_arithmetic(layers, plan, message):
    with pytest.raises(ConfigError) as err:
        plan.check_fits(model(layers))
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs,message", [
    (dict(decoder_first_pipeline_num_layers=2), "parallel.decoder_first_pipeline_num_layers requires "
                                                "pipeline_parallel > 1 (got 1)"),
    (dict(pipeline_parallel=2, decoder_last_pipeline_num_layers=0),
     "parallel.decoder_last_pipeline_num_layers must be positive, got 0"),
    (dict(pipeline_parallel=2, decoder_first_pipeline_num_layers=2, account_for_loss_in_pipeline_split=True),
     "parallel.decoder_first_pipeline_num_layers cannot be combined with parallel.account_for_loss_in_pipeline_split "
     "(Megatron-Core allows one form of uneven pipeline split)"),
    (dict(account_for_embedding_in_pipeline_split="yes"),
     "parallel.account_for_embedding_in_pipeline_split must be true or false, got 'yes'"),
])
def test_split_fields_are_validated(kwargs, message):
    with pytest.raises(ConfigError) as err:
        ParallelPlan(**kwargs)
    assert str(err.value) == message


def test_embedding_and_loss_slots_are_a_no_op_without_a_pipeline():
    plan = ParallelPlan(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert plan.chunk_layers(model(5)) == ((5,),)


@pytest.mark.parametrize("layout, message", [
    ("Et|(tt|)*30mL", "parallel.pipeline_layout 'Et|(tt|)*30mL' places 1 multi-token prediction layers (m), not "
                      "mtp_num_layers (0)"),
    ("Et|(tt|)*29L", "parallel.pipeline_layout 'Et|(tt|)*29L' has 31 stages, not pipeline_parallel (16) x "
                     "virtual_pipeline (2) = 32"),
    ("tE|(tt|)*30L", "parallel.pipeline_layout 'tE|(tt|)*30L': the embedding (E) must come first and the loss (L) "
                     "last, once each"),
    ("Et|(tt|)*29|tL", "parallel.pipeline_layout 'Et|(tt|)*29|tL' places 60 layers (t), not num_layers (61)"),
    ("Ex|(tt|)*30L", "parallel.pipeline_layout 'Ex|(tt|)*30L': 'x' is none of E (embedding), t (layer), m "
                     "(multi-token prediction), L (loss)"),
])
def test_a_layout_that_does_not_lay_out_the_model_is_refused_in_one_line(layout, message):
    plan = ParallelPlan(pipeline_parallel=16, virtual_pipeline=2, pipeline_layout=layout)
    with pytest.raises(ConfigError) as err:
        plan.check_fits(model(61))
    assert str(err.value) == message


def test_deepseek_v3s_layout_with_its_mtp_layer_is_megatron_cores():
    plan = ParallelPlan(pipeline_parallel=8, virtual_pipeline=4, pipeline_layout="Et|(tt|)*30mL")
    assert [list(chunks) for chunks in plan.chunk_layers(model(61, mtp=1))] == megatron_layers(61, plan, mtp=1)
    with pytest.raises(ConfigError) as err:  # megatron-core's "standalone" MTP stage, apart from the loss
        ParallelPlan(pipeline_parallel=8, virtual_pipeline=4, pipeline_layout="Et|(tt|)*29ttm|L").check_fits(
            model(61, mtp=1))
    assert str(err.value) == ("parallel.pipeline_layout 'Et|(tt|)*29ttm|L': vtrain models the multi-token "
                              "prediction layers (m) in the last stage, before the loss (L), as megatron-core places "
                              "them by default")
