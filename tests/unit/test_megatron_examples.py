"""Megatron-LM's own example scripts (re-typed in tests/unit/megatron_examples.py) read as vtrain runs,
field by field."""

import logging

import pytest

from vtrain_plugin.api import load_megatron_script, load_run_config, run_config_from_megatron_args, with_gpu
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.launch_script import read_launch_script
from vtrain_plugin.specs.megatron_args import script_plan
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, GradReduce, ScheduleKind, SoftwareStack, TrainingSpec

from tests.unit.megatron_examples import GPT3_175B, GPT_345M_WITH_MP, LLAMA3_8B_BF16_FLAGS, LLAMA3_8B_FP8, MIXTRAL_8X7B

GPT2_TOKENIZER = "--tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB_FILE"


def line_of(script: str, text: str) -> int:
    return next(n for n, line in enumerate(script.splitlines(), 1) if text in line)


def test_gpt3_175b_as_published_asks_for_the_vocabulary_size():
    # The script names GPT-2's vocabulary files but no --tokenizer-type: the size is not stated.
    with pytest.raises(ConfigError) as exc:
        script_plan(read_launch_script(GPT3_175B))
    assert str(exc.value) == ("the vocabulary size is unknown (no --tokenizer-type): give --vocab-size N, the "
                              "tokenizer's size before Megatron-LM pads it")


def test_gpt3_175b_on_its_one_node_of_8_gpus_cannot_hold_tp8_x_pp16():
    script = GPT3_175B.replace("--vocab-file $VOCAB_FILE", GPT2_TOKENIZER)
    with pytest.raises(ConfigError) as exc:
        script_plan(read_launch_script(script))
    assert str(exc.value) == (
        "GPUs (8) must be a multiple of --tensor-model-parallel-size (8) x --pipeline-model-parallel-size (16) x "
        "--context-parallel-size (1) = 128: data parallel size = 8 / 128 = 0.0625")


def test_gpt3_175b_on_64_nodes_field_by_field():
    script = GPT3_175B.replace("NUM_NODES=1", "NUM_NODES=64").replace("--vocab-file $VOCAB_FILE", GPT2_TOKENIZER)
    (command,) = read_launch_script(script)
    assert (command.nnodes, command.nproc_per_node, command.script) == ("64", "8", "pretrain_gpt.py")
    assert command.megatron_args[-4:] == ("--eval-iters", "10", "--tensorboard-dir", "$2")  # unset: its own text
    plan = script_plan((command,))
    assert plan.model == ModelSpec(family=Family.GPT, num_layers=96, hidden_size=12288, num_attention_heads=96,
                                   seq_length=2048, vocab_size=50257, ffn_hidden_size=49152, tied_embeddings=True,
                                   dtype=Dtype.FP16)
    assert plan.model.padded_vocab_size(8) == 51200
    assert plan.parallel == ParallelPlan(tensor_parallel=8, pipeline_parallel=16, data_parallel=4,
                                         micro_batch_size=1, recompute=Recompute.NONE)
    # Megatron-LM 0.16 runs TransformerEngine layers unless told otherwise, on any GPU and in fp16 too.
    assert plan.training == TrainingSpec(global_batch_size=1536, schedule=ScheduleKind.ONE_F_ONE_B,
                                         grad_reduce=GradReduce.AFTER_BACKWARD,
                                         software_stack=SoftwareStack.MEGATRON_CORE_TE,
                                         reliability=ReliabilitySpec(checkpoint_interval_iterations=10000))
    assert plan.stack_reason == "--transformer-impl transformer_engine (Megatron-LM's default)"
    assert plan.unmodelled == ("--rampup-batch-size 16 16 5859375",)  # --attention-backend auto: TE's fused attention


def test_gpt3_175b_megatron_args_are_the_plan_of_vtrains_gpt3_config():
    """The vTrain config examples/configs/gpt3_175b_512gpu.json, written as Megatron-LM flags."""
    flags = ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
             "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 --fp16 "
             "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --tokenizer-type GPT2BPETokenizer "
             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --use-legacy-models")
    ours = run_config_from_megatron_args(flags, gpus=512)
    theirs = load_run_config("examples/configs/gpt3_175b_512gpu.json")
    assert ours.parallel == theirs.parallel
    assert ours.cluster == theirs.cluster
    assert ours.training.stack_for(ours.model, "ampere") is theirs.training.stack_for(theirs.model, "ampere") \
        is SoftwareStack.MEGATRON_DEEPSPEED_2023
    for spec in (ours.model, theirs.model):
        assert (spec.family, spec.ffn_size, spec.query_groups, spec.tied, spec.padded_vocab_size(8), spec.dtype,
                spec.num_layers, spec.hidden_size, spec.seq_length) == \
            (Family.GPT, 49152, 96, True, 51200, Dtype.FP16, 96, 12288, 2048)


def test_gpt_345m_with_string_variables_and_line_continuations(tmp_path):
    script = tmp_path / "pretrain_gpt_distributed_with_mp.sh"
    script.write_text(GPT_345M_WITH_MP.replace("--vocab-file $VOCAB_FILE", GPT2_TOKENIZER))
    run = load_megatron_script(script)
    assert run.source == str(script)
    assert run.model == ModelSpec(family=Family.GPT, num_layers=24, hidden_size=1024, num_attention_heads=16,
                                  seq_length=1024, vocab_size=50257, ffn_hidden_size=4096, tied_embeddings=True,
                                  dtype=Dtype.FP16)
    assert run.parallel == ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=2,
                                        sequence_parallel=True, micro_batch_size=2)
    assert run.training == TrainingSpec(global_batch_size=16, software_stack=SoftwareStack.MEGATRON_CORE_TE,
                                        reliability=ReliabilitySpec(checkpoint_interval_iterations=10000))
    assert run.num_microbatches == 4


def test_llama3_8b_fp8_script_depends_on_its_if_blocks():
    (fp8_block, mock_block, real_block) = (line_of(LLAMA3_8B_FP8, 'if [[ "$DTYPE" == "fp8" ]]'),
                                           line_of(LLAMA3_8B_FP8, 'if [[ "$TOKENIZER_ARG" == "MOCK" ]]'),
                                           line_of(LLAMA3_8B_FP8, "else"))
    commands = read_launch_script(LLAMA3_8B_FP8)
    assert commands[0].blocks == (fp8_block, mock_block, real_block)
    assert len(commands) == 8  # each block run or not
    with pytest.raises(ConfigError) as exc:
        script_plan(commands)
    assert str(exc.value) == (
        f"line {line_of(LLAMA3_8B_FP8, 'torchrun')}: the plan depends on whether the if/for/while/case blocks at "
        f"lines {fp8_block}, {mock_block}, {real_block} run, which set variables the training command reads; "
        f"vtrain reads the script without running it, so write those flags outside the blocks")


def test_llama3_8b_fp8_flags_set_fp8_and_need_a_gpu_with_fp8():
    flags = LLAMA3_8B_BF16_FLAGS + " --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-param-gather"
    run = run_config_from_megatron_args(flags, gpus=8, cluster=get_cluster_preset("dgx-h100"))
    assert (run.training.fp8, run.training.fp8_recipe) == (Fp8Format.HYBRID, Fp8Recipe.DELAYED)
    with pytest.raises(ConfigError, match=r"^training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb "):
        with_gpu(run, "A100")
    run = run_config_from_megatron_args(LLAMA3_8B_BF16_FLAGS + " --use-distributed-optimizer --overlap-param-gather",
                                        gpus=8)
    assert run.training.distributed_optimizer and run.training.overlap_param_gather


def test_llama3_8b_bf16_field_by_field(caplog):
    # The example keeps Megatron-LM's default LayerNorm (with --apply-layernorm-1p) under a SwiGLU MLP:
    # a llama layer to vtrain, the normalization noted in the warning.
    with caplog.at_level(logging.WARNING, logger="vtrain_plugin.api"):
        run = run_config_from_megatron_args("torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py \\\n"
                                            + LLAMA3_8B_BF16_FLAGS.replace("\n", " \\\n"))
    assert run.model == ModelSpec(family=Family.LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                  num_query_groups=8, ffn_hidden_size=14336, seq_length=8192,
                                  vocab_size=128257,  # NullTokenizer: --vocab-size plus its end-of-document token
                                  tied_embeddings=False, dtype=Dtype.BF16)
    assert run.parallel == ParallelPlan(tensor_parallel=1, pipeline_parallel=1, data_parallel=8,
                                        sequence_parallel=False, micro_batch_size=1)
    assert run.training == TrainingSpec(global_batch_size=128, grad_reduce=GradReduce.OVERLAP,
                                        bucket_size_mb=80.0,  # Megatron's 4e7 parameters x 2 bytes (bf16 grads)
                                        software_stack=SoftwareStack.MEGATRON_CORE_TE, grad_reduce_in_bf16=True,
                                        cross_entropy_fusion=True,
                                        reliability=ReliabilitySpec(checkpoint_interval_iterations=1000))
    # --attention-backend fused is TE's attention as costed; --apply-layernorm-1p is the same norm kernel.
    assert [r.getMessage() for r in caplog.records] == [
        "warning: Megatron-LM arguments vtrain does not model (they may change speed or memory): "
        "--empty-unused-memory-level 1, --normalization LayerNorm (vtrain's llama layers: RMSNorm), "
        "--sequence-parallel at TP 1 (Megatron-LM turns it off)"]


def test_mixtral_8x7b_field_by_field(tmp_path, caplog):
    # The optional wandb block does not change the plan. The script names a tokenizer model file, not
    # the vocabulary size; and on its default single node (NNODES=${SLURM_NNODES:-"1"}) DP is 2, too
    # few ranks for EP 8, as Megatron-LM would also find.
    script = tmp_path / "train_mixtral_8x7b_distributed.sh"
    script.write_text(MIXTRAL_8X7B)
    assert len(read_launch_script(MIXTRAL_8X7B)) == 2
    with pytest.raises(ConfigError) as exc:
        load_megatron_script(script)
    assert str(exc.value) == (f"{script}: the vocabulary size is unknown (--tokenizer-type Llama2Tokenizer): give "
                              f"--vocab-size N, the tokenizer's size before Megatron-LM pads it")
    sized = MIXTRAL_8X7B.replace("--tokenizer-type Llama2Tokenizer", "--tokenizer-type Llama2Tokenizer --vocab-size 32000")
    script.write_text(sized)
    with pytest.raises(ConfigError) as exc:
        load_megatron_script(script)
    assert str(exc.value) == (f"{script}: expert_parallel (8) * expert_tensor_parallel (1) = 8 must divide "
                              f"tensor_parallel (1) * context_parallel (1) * data_parallel (2) = 2: the expert ranks "
                              f"of a pipeline stage are its TP x CP x DP ranks")
    script.write_text(sized.replace('NNODES=${SLURM_NNODES:-"1"}', 'NNODES=${SLURM_NNODES:-"4"}'))
    with caplog.at_level(logging.WARNING, logger="vtrain_plugin.api"):
        run = load_megatron_script(script)
    assert run.model == ModelSpec(family=Family.LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                  num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, vocab_size=32000,
                                  tied_embeddings=False, dtype=Dtype.BF16, num_experts=8, moe_router_topk=2)
    assert run.parallel == ParallelPlan(tensor_parallel=1, pipeline_parallel=4, data_parallel=8, micro_batch_size=1,
                                        expert_parallel=8, moe_token_dispatcher="alltoall")
    assert run.training == TrainingSpec(global_batch_size=256, grad_reduce=GradReduce.OVERLAP, bucket_size_mb=160.0,
                                        distributed_optimizer=True, overlap_param_gather=True,
                                        software_stack=SoftwareStack.MEGATRON_CORE_TE,
                                        reliability=ReliabilitySpec(checkpoint_interval_iterations=10000))
    assert [r.getMessage() for r in caplog.records] == [
        f"warning: {script}: Megatron-LM arguments vtrain does not model (they may change speed or memory): "
        "--no-masked-softmax-fusion, --moe-grouped-gemm, --sequence-parallel at TP 1 (Megatron-LM turns it off)"]