"""Megatron-LM's own example scripts (re-typed in tests/fixtures/launch_scripts) read as vtrain runs,
field by field."""

import logging
import os
import shutil
import subprocess

import pytest

from vtrain_plugin.runs import load_megatron_script, load_run_config, run_config_from_megatron_args, with_gpu
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.megatron.launch_script import read_launch_script
from vtrain_plugin.specs.megatron.args import script_plan
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan, Recompute
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, GradReduce, ScheduleKind, SoftwareStack, TrainingSpec

from tests.support import megatron_examples
from tests.support.megatron_examples import (GPT3_175B, GPT_345M_WITH_MP, LLAMA2_SLURM, LLAMA3_8B_BF16_FLAGS,
                                         LLAMA3_8B_FP8, MIXTRAL_8X7B)

GPT2_TOKENIZER = "--tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB_FILE"


def line_of(script: str, text: str) -> int:
    return next(n for n, line in enumerate(script.splitlines(), 1) if text in line)


def test_gpt3_175b_as_published_on_512_gpus():
    # The script names GPT-2's vocabulary and merge files (script arguments $3 and $4) but no
    # --tokenizer-type: GPT-2's 50257 tokens, noted. Its one node of 8 GPUs cannot hold TP 8 x PP 16;
    # --gpus 512 overrides it, noted too.
    commands = read_launch_script(GPT3_175B)
    assert [(c.nnodes, c.nproc_per_node) for c in commands] == [("1", "8")]
    with pytest.raises(ConfigError) as exc:
        script_plan(commands)
    assert str(exc.value) == (
        "GPUs (8) must be a multiple of --tensor-model-parallel-size (8) x --pipeline-model-parallel-size (16) x "
        "--context-parallel-size (1) = 128: data parallel size = 8 / 128 = 0.0625")
    plan = script_plan(commands, gpus=512)
    assert plan.model == ModelSpec(family=Family.GPT, num_layers=96, hidden_size=12288, num_attention_heads=96,
                                   seq_length=2048, vocab_size=50257, ffn_hidden_size=49152, tied_embeddings=True,
                                   dtype=Dtype.FP16)
    assert plan.parallel == ParallelPlan(tensor_parallel=8, pipeline_parallel=16, data_parallel=4,
                                         micro_batch_size=1, recompute=Recompute.NONE)
    assert (plan.training.global_batch_size, plan.training.fp8) == (1536, None)
    assert plan.assumed == (
        "--gpus 512 overrides the script's 1 node x 8 GPUs = 8",
        "--vocab-file and --merge-file (no --tokenizer-type) taken as GPT-2's BPE files (50257 tokens; add "
        "--vocab-size N if not)")


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


def test_llama3_8b_fp8_script_decides_its_if_blocks_on_its_literal_settings():
    # DTYPE="fp8" runs the fp8 block; TOKENIZER_ARG=${3:-"MOCK"} (no script arguments) runs the mock-data
    # branch; "--data-cache-path ${DATA_CACHE_PATH}" stays one flag and its value though $PWD is unset.
    (command,) = read_launch_script(LLAMA3_8B_FP8)
    assert command.blocks == ()
    assert (command.nnodes, command.nproc_per_node, command.script) == ("1", "8", "pretrain_gpt.py")
    args = command.megatron_args
    assert args[args.index("--fp8-format"):args.index("--fp8-format") + 7] == (
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
        "--fp8-param-gather")
    assert args[args.index("--mock-data"):args.index("--mock-data") + 8] == (
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path",
        "/benchmark_cache_llama3_8b_fp8", "--tiktoken-pattern")
    assert "--data-path" not in args and "--save" in args
    for gpus, data_parallel in ((None, 8), (512, 512)):
        plan = script_plan((command,), gpus=gpus)
        assert plan.model == ModelSpec(family=Family.LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                       num_query_groups=8, ffn_hidden_size=14336, seq_length=8192, vocab_size=128257,
                                       tied_embeddings=False, dtype=Dtype.BF16, normalization="LayerNorm",
                                       layernorm_zero_centered_gamma=True)
        assert plan.parallel == ParallelPlan(tensor_parallel=1, pipeline_parallel=1, data_parallel=data_parallel,
                                             sequence_parallel=False, micro_batch_size=1)
        assert (plan.training.global_batch_size, plan.training.fp8, plan.training.fp8_recipe,
                plan.training.distributed_optimizer, plan.training.overlap_param_gather) == (
            128, Fp8Format.HYBRID, Fp8Recipe.DELAYED, True, True)
        assert plan.assumed == (() if gpus is None else ("--gpus 512 overrides the script's 1 node x 8 GPUs = 8",))


def test_llama3_8b_fp8_script_with_an_unknown_dtype_depends_on_its_fp8_block():
    # With the dtype left to a command substitution, the fp8 block is not known without running the
    # script, and it changes the plan.
    script = LLAMA3_8B_FP8.replace('DTYPE="fp8"', 'DTYPE="$(cat dtype.txt)"')
    fp8_block = line_of(script, 'if [[ "$DTYPE" == "fp8" ]]')
    commands = read_launch_script(script)
    assert commands[0].blocks == (fp8_block,) and len(commands) == 2
    with pytest.raises(ConfigError) as exc:
        script_plan(commands)
    assert str(exc.value) == (
        f"line {line_of(script, 'torchrun')}: the plan depends on whether the if/for/while/case blocks at "
        f"line {fp8_block} run, which set variables the training command reads; vtrain reads the script without "
        f"running it, so write those flags outside the blocks")


def test_llama3_8b_fp8_flags_set_fp8_and_need_a_gpu_with_fp8():
    flags = LLAMA3_8B_BF16_FLAGS + " --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-param-gather"
    run = run_config_from_megatron_args(flags, gpus=8, cluster=get_cluster_preset("dgx-h100"))
    assert (run.training.fp8, run.training.fp8_recipe) == (Fp8Format.HYBRID, Fp8Recipe.DELAYED)
    with pytest.raises(ConfigError, match=r"^training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb "):
        with_gpu(run, "A100")
    run = run_config_from_megatron_args(LLAMA3_8B_BF16_FLAGS + " --use-distributed-optimizer --overlap-param-gather",
                                        gpus=8)
    assert run.training.distributed_optimizer and run.training.overlap_param_gather


# A Megatron-LM input names no GPU: the default one, said in the note.
DEFAULT_GPU_NOTE = "no GPU given: estimated on a100-sxm4-80gb (dgx-a100 nodes), the default; give --gpu to choose"


def test_llama3_8b_bf16_field_by_field(caplog):
    # The example keeps Megatron-LM's default LayerNorm (with --apply-layernorm-1p) under a SwiGLU MLP:
    # a llama layer with a LayerNorm, as megatron-core builds it.
    with caplog.at_level(logging.WARNING, logger="vtrain_plugin.runs"):
        run = run_config_from_megatron_args("torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py \\\n"
                                            + LLAMA3_8B_BF16_FLAGS.replace("\n", " \\\n"))
    assert run.model == ModelSpec(family=Family.LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                  num_query_groups=8, ffn_hidden_size=14336, seq_length=8192,
                                  vocab_size=128257,  # NullTokenizer: --vocab-size plus its end-of-document token
                                  tied_embeddings=False, dtype=Dtype.BF16, normalization="LayerNorm",
                                  layernorm_zero_centered_gamma=True)
    assert run.parallel == ParallelPlan(tensor_parallel=1, pipeline_parallel=1, data_parallel=8,
                                        sequence_parallel=False, micro_batch_size=1)
    assert run.training == TrainingSpec(global_batch_size=128, grad_reduce=GradReduce.OVERLAP,
                                        bucket_size_mb=80.0,  # Megatron's 4e7 parameters x 2 bytes (bf16 grads)
                                        software_stack=SoftwareStack.MEGATRON_CORE_TE, grad_reduce_in_bf16=True,
                                        cross_entropy_fusion=True, per_token_loss=True, manual_gc=True,
                                        reliability=ReliabilitySpec(checkpoint_interval_iterations=1000))
    # --attention-backend fused is TE's attention as costed; --apply-layernorm-1p is the same norm kernel.
    assert [r.getMessage() for r in caplog.records] == [
        f"note: {DEFAULT_GPU_NOTE}",
        "warning: Megatron-LM arguments vtrain does not model (they may change speed or memory): "
        "--empty-unused-memory-level 1, "
        "--sequence-parallel at TP 1 (Megatron-LM turns it off)"]


def test_mixtral_8x7b_field_by_field(tmp_path, caplog):
    # WANDB_API_KEY is unset: the wandb block does not run. The Llama-2 tokenizer of the script (its
    # model file is the script argument $2) has 32000 tokens, noted. On its default single node
    # (NNODES=${SLURM_NNODES:-"1"}) DP is 2, too few ranks for EP 8, as Megatron-LM would also find;
    # --gpus 32 overrides the node count.
    script = tmp_path / "train_mixtral_8x7b_distributed.sh"
    script.write_text(MIXTRAL_8X7B)
    (command,) = read_launch_script(MIXTRAL_8X7B)
    assert (command.nnodes, command.blocks) == ("1", ())
    assert "--wandb-project" not in command.megatron_args
    with pytest.raises(ConfigError) as exc:
        load_megatron_script(script)
    assert str(exc.value) == (f"{script}: expert_parallel (8) * expert_tensor_parallel (1) = 8 must divide "
                              f"tensor_parallel (1) * context_parallel (1) * data_parallel (2) = 2: the expert ranks "
                              f"of a pipeline stage are its TP x CP x DP ranks")
    with caplog.at_level(logging.WARNING, logger="vtrain_plugin.runs"):
        run = load_megatron_script(script, gpus=32)
    assert run.model == ModelSpec(family=Family.LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                  num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, vocab_size=32000,
                                  tied_embeddings=False, dtype=Dtype.BF16, num_experts=8, moe_router_topk=2,
                                  moe_grouped_gemm=True)
    assert run.parallel == ParallelPlan(tensor_parallel=1, pipeline_parallel=4, data_parallel=8, micro_batch_size=1,
                                        expert_parallel=8, moe_token_dispatcher="alltoall")
    assert run.training == TrainingSpec(global_batch_size=256, grad_reduce=GradReduce.OVERLAP, bucket_size_mb=160.0,
                                        distributed_optimizer=True, overlap_param_gather=True,
                                        software_stack=SoftwareStack.MEGATRON_CORE_TE,
                                        unfused_kernels=("masked_softmax",),  # which TE's attention ignores
                                        reliability=ReliabilitySpec(checkpoint_interval_iterations=10000))
    assert [r.getMessage() for r in caplog.records] == [
        f"note: {script}: --gpus 32 overrides the script's 1 node x 8 GPUs = 8; --tokenizer-type Llama2Tokenizer "
        f"taken as Llama-2's SentencePiece model (32000 tokens; add --vocab-size N if not); {DEFAULT_GPU_NOTE}",
        f"warning: {script}: Megatron-LM arguments vtrain does not model (they may change speed or memory): "
        "--sequence-parallel at TP 1 (Megatron-LM turns it off)"]
    on_slurm = MIXTRAL_8X7B.replace('NNODES=${SLURM_NNODES:-"1"}', 'NNODES=${SLURM_NNODES:-"4"}')
    assert script_plan(read_launch_script(on_slurm)).parallel == run.parallel


@pytest.mark.parametrize("size, layers, hidden, ffn, heads, groups, tp, pp, tokenizer", [
    ("7B", 32, 4096, 11008, 32, None, 1, 1, "meta-llama/Llama-2-7b-hf"),
    ("70B", 80, 8192, 28672, 64, 8, 8, 4, "meta-llama/Llama-2-70b-hf"),
])
def test_llama2_slurm_script_field_by_field(size, layers, hidden, ffn, heads, groups, tp, pp, tokenizer):
    # MODEL_SIZE=${MODEL_SIZE:-"7B"} picks an if/elif branch; the node count is
    # ${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}, 1 outside SLURM, so --gpus 64 overrides it.
    script = LLAMA2_SLURM.replace('MODEL_SIZE=${MODEL_SIZE:-"7B"}', f'MODEL_SIZE=${{MODEL_SIZE:-"{size}"}}')
    (command,) = read_launch_script(script)
    assert (command.nnodes, command.nproc_per_node, command.blocks) == ("1", "8", ())
    args = command.megatron_args
    assert args[args.index("--data-path"):args.index("--split")] == (
        "--data-path", "/lustre/data/redpajama_text_document", "--data-cache-path", "/data_cache",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer)
    assert args[-6:] == ("--save", f"/checkpoints/llama2_{size}", "--load", f"/checkpoints/llama2_{size}",
                         "--save-interval", "1000")
    plan = script_plan((command,), gpus=64)
    assert plan.model == ModelSpec(family=Family.LLAMA, num_layers=layers, hidden_size=hidden,
                                   num_attention_heads=heads, num_query_groups=groups, ffn_hidden_size=ffn,
                                   seq_length=4096, vocab_size=32000, tied_embeddings=False, dtype=Dtype.BF16)
    assert plan.parallel == ParallelPlan(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=64 // (tp * pp),
                                         sequence_parallel=tp > 1, micro_batch_size=1)
    assert (plan.training.global_batch_size, plan.training.fp8, plan.training.distributed_optimizer) == (
        1024, None, True)
    assert plan.assumed == ("--gpus 64 overrides the script's 1 node x 8 GPUs = 8",
                            f"--tokenizer-model {tokenizer} (32000 tokens; add --vocab-size N if not)")


@pytest.mark.parametrize("name", ["GPT3_175B", "GPT_345M_WITH_MP", "LLAMA3_8B_FP8", "MIXTRAL_8X7B"])
def test_example_scripts_read_as_bash_runs_them(name, tmp_path):
    """bash runs each script (torchrun a function that prints its words) in an environment of PATH and
    PWD, the same PWD given to vtrain. Scripts whose paths are arguments ($1 ...) get their own names as
    arguments, which is how vtrain keeps a bare $1; the Llama-3 script has defaults for its arguments
    and gets none."""
    script = getattr(megatron_examples, name)
    arguments = [] if "${1:-" in script else [f"${k}" for k in range(1, 6)]
    (tmp_path / "pretrain_gpt.py").write_text("")
    bash = shutil.which("bash")
    assert bash is not None, "bash is the oracle of this test"
    proc = subprocess.run([bash, "--norc", "--noprofile", "-c",
                           "torchrun() { for w in \"$@\"; do printf '[%s]\\n' \"$w\"; done; }\n" + script, "train.sh",
                           *arguments], capture_output=True, text=True, env={"PATH": os.defpath, "PWD": str(tmp_path)},
                          cwd=tmp_path,
                          check=True, timeout=30)
    words = [line[1:-1] for line in proc.stdout.splitlines() if line.startswith("[")]
    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    (command,) = read_launch_script(script, {"PWD": str(tmp_path)})
    assert command.megatron_args == tuple(words[at + 1:])
    assert (command.nnodes, command.nproc_per_node) == (words[words.index("--nnodes") + 1],
                                                        words[words.index("--nproc_per_node") + 1])
