"""``vtrain estimate`` from Megatron-LM arguments: a launch script and --megatron-args, in a subprocess."""

import json

import pytest

from tests.support.megatron_examples import GPT3_175B, LLAMA3_8B_FP8, SMALL_GPT

SLURM_GPT = """#!/bin/bash
NNODES=${SLURM_NNODES:-1}
MODEL_SIZE=${MODEL_SIZE:-"small"}
if [ "$MODEL_SIZE" = big ]; then LAYERS=8; else LAYERS=4; fi
torchrun --nnodes $NNODES --nproc-per-node 4 pretrain_gpt.py --num-layers $LAYERS --hidden-size 256 \\
    --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 --global-batch-size 32 --vocab-size 1000 \\
    --tensor-model-parallel-size 2
"""


def test_estimate_from_a_launch_script_takes_the_gpu_count_from_torchrun(tmp_path, run_cli):
    script = tmp_path / "train_small.sh"
    script.write_text(SMALL_GPT)
    proc = run_cli("estimate", str(script), "--format", "json", check=True)
    result = json.loads(proc.stdout)
    assert result["config"] == str(script)
    assert result["num_gpus"] == 8 and result["num_microbatches"] == 32 // (2 * 2)
    # Megatron-LM's TransformerEngine layers, though an fp16 GPT on an A100 defaults to Megatron-DeepSpeed's kernels
    assert result["iteration_time_ms"] > 0 and result["software_stack"] == "megatron_core_te"
    assert proc.stderr.splitlines() == [
        f"vtrain: note: {script}: no GPU given: estimated on a100-sxm4-80gb (dgx-a100 nodes), the default; give "
        f"--gpu to choose",
        f"vtrain: warning: {script}: Megatron-LM arguments vtrain does not model (they may change speed or "
        f"memory): --use-flash-attn"]
    script.write_text(SMALL_GPT.replace("--use-flash-attn", "--transformer-impl local"))
    local = json.loads(run_cli("estimate", str(script), "--format", "json", check=True).stdout)
    assert local["software_stack"] == "megatron_core_local"


def test_a_bert_script_is_refused_as_unsupported_in_one_line(tmp_path, run_cli):
    script = tmp_path / "train_bert.sh"
    script.write_text(SMALL_GPT.replace("pretrain_gpt.py", "pretrain_bert.py"))
    proc = run_cli("estimate", str(script))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"vtrain: error: {script}: pretrain_bert.py: BERT models are not supported by "
                                        f"vtrain (it estimates GPT decoders, Megatron-LM's pretrain_gpt.py)"]


def test_megatron_args_errors_are_one_line_with_exit_2(tmp_path, run_cli):
    flags = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 2"
    unknown = run_cli("estimate", "--megatron-args", f"{flags} --vocab-size 1000 --deepspeed-zero 3", "--gpus", "8")
    assert unknown.returncode == 2
    assert unknown.stderr.splitlines() == ["vtrain: error: --megatron-args: unknown argument --deepspeed-zero: no "
                                           "Megatron-LM release from core_r0.8.0 to main has it"]
    arithmetic = run_cli("estimate", "--megatron-args", f"{flags} --vocab-size 1000 --tensor-model-parallel-size 4",
                         "--gpus", "6", "--format", "jsonl")
    assert arithmetic.returncode == 2
    assert json.loads(arithmetic.stdout) == {
        "config": "--megatron-args",
        "error": "--megatron-args: GPUs (6) must be a multiple of --tensor-model-parallel-size (4) x "
                 "--pipeline-model-parallel-size (1) x --context-parallel-size (1) = 4: data parallel size = "
                 "6 / 4 = 1.5"}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text("{}")
    misplaced = run_cli("estimate", str(plan_file), "--gpus", "8")
    assert misplaced.returncode == 2
    assert misplaced.stderr.splitlines() == [f"vtrain: error: --gpus applies to Megatron-LM arguments only "
                                             f"(--megatron-args, a .sh launch script or a Megatron-Bridge YAML): "
                                             f"{plan_file} gives its data-parallel size"]


def test_megatron_lms_example_scripts_with_gpus_overriding_their_one_node(tmp_path, run_cli):
    # GPT-3 175B as published (GPT-2 vocabulary files, no --tokenizer-type) and Llama-3 8B fp8 (its
    # if blocks decided on DTYPE="fp8" and the mock-data default), both written for one node of 8 GPUs.
    scripts = {"train_gpt3_175b_distributed.sh": GPT3_175B, "train_llama3_8b_h100_fp8.sh": LLAMA3_8B_FP8}
    paths = []
    for name, text in scripts.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(text)
    proc = run_cli("estimate", *map(str, paths), "--gpus", "128", "--gpu", "H100", "--format", "jsonl", check=True)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["config"], r["num_gpus"], r["global_batch_size"], r["num_microbatches"], r["fp8"],
             r["distributed_optimizer"], r["gpu"]) for r in results] == [
        (str(paths[0]), 128, 1536, 1536 // (1 * 1), None, False, "h100-sxm"),  # TP 8 x PP 16: DP 1
        (str(paths[1]), 128, 128, 128 // (1 * 128), "hybrid", True, "h100-sxm")]  # TP 1: DP 128
    assert [line for line in proc.stderr.splitlines() if line.startswith("vtrain: note:")] == [
        f"vtrain: note: {paths[0]}: --gpus 128 overrides the script's 1 node x 8 GPUs = 8; --vocab-file and "
        f"--merge-file (no --tokenizer-type) taken as GPT-2's BPE files (50257 tokens; add --vocab-size N if not)",
        f"vtrain: note: {paths[1]}: --gpus 128 overrides the script's 1 node x 8 GPUs = 8"]


def test_env_gives_the_variables_a_launch_script_reads(tmp_path, run_cli):
    script = tmp_path / "train_slurm.sh"
    script.write_text(SLURM_GPT)
    plain = run_cli("estimate", str(script), "--format", "json", check=True)
    assert json.loads(plain.stdout)["num_gpus"] == 4  # SLURM_NNODES unset: ${SLURM_NNODES:-1}
    given = run_cli("estimate", str(script), "--env", "SLURM_NNODES=4", "--env", "MODEL_SIZE=big", "--format", "json",
                    check=True)
    assert json.loads(given.stdout)["num_gpus"] == 16
    assert json.loads(given.stdout)["num_microbatches"] == 32 // (8 * 1)  # DP 16 / TP 2 = 8
    bad = run_cli("estimate", str(script), "--env", "1X=2")
    assert (bad.returncode, bad.stderr.splitlines()) == (
        2, ["vtrain: error: --env 1X=2: expected NAME=VALUE with NAME a shell variable name"])


def test_the_llama3_8b_fp8_recipe_is_costed_with_fp8_weights_and_bf16_gradients(tmp_path, run_cli):
    # NVIDIA's recipe on its own node: --fp8-param-gather keeps the linear weights in one byte (and
    # a one-byte transpose), --grad-reduce-in-bf16 the gradients in two; the 8.03B parameters' model
    # states are then 15.0 + 15.0 + 11.2 GiB, and the verdict tells the tensors from the allowance.
    script = tmp_path / "train_llama3_8b_h100_fp8.sh"
    script.write_text(LLAMA3_8B_FP8)
    plan = json.loads(run_cli("estimate", str(script), "--gpu", "H100", "--format", "json", check=True).stdout)
    training = plan["plan"]["training"]
    assert (training["fp8"], training["fp8_param_gather"], training["grad_reduce_in_bf16"],
            training["cross_entropy_fusion"], training["software_stack"]) == ("hybrid", True, True, True,
                                                                             "megatron_core_te")
    table = run_cli("estimate", str(script), "--gpu", "H100", check=True).stdout
    memory = next(line for line in table.splitlines() if line.startswith("memory per GPU"))
    stage = plan["memory_gib_per_stage"][0]
    tensors = stage["weights"] + stage["gradients"] + stage["optimizer"] + stage["activations"] + stage["workspaces"]
    # the model states are known exactly; the activations are the memory model's (they include the
    # fused cross entropy's fp32 logits and the bf16 logits gradient of the 128,256-word vocabulary)
    assert f"(allocated {tensors:.1f}: weights 15.0, gradients 15.0, optimizer 11.2," in memory
    assert plan["peak_allocated_gib"] == pytest.approx(tensors) and plan["gpu_usable_memory_gib"] == 79.1787109375
    assert plan["fits_in_memory"] is (stage["total"] <= 79.1787109375)
    # PyTorch's cuBLAS workspace on Hopper (the output layer's GEMMs) and TransformerEngine's
    assert stage["workspaces"] * 1024**3 == 32 * 1024**2 + 32 * 1024**2 + 1024
    assert memory.startswith(f"memory per GPU (peak stage): {stage['total']:.1f} GiB of 79.2 GiB usable, ")


def test_deterministic_mode_with_unfused_attention_is_priced_not_refused(run_cli):
    # the shape of NVIDIA's functional tests (gpt3_mcore_te_*_deterministic), shrunk
    flags = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
             "--micro-batch-size 2 --global-batch-size 16 --vocab-size 1000 --tensor-model-parallel-size 2 "
             "--transformer-impl transformer_engine --bf16 --deterministic-mode --attention-backend unfused "
             "--use-tp-pp-dp-mapping --use-distributed-optimizer --use-precision-aware-optimizer "
             "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
    proc = run_cli("estimate", "--megatron-args", flags, "--gpus", "8", "--format", "json", check=True)
    result = json.loads(proc.stdout)
    assert result["iteration_time_ms"] > 0 and result["software_stack"] == "megatron_core_te"
    assert any(line.startswith("deterministic mode") for line in result["assumptions"])
    assert any(line.startswith("unfused attention") for line in result["assumptions"])
