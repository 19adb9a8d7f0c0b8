"""NVIDIA's functional-test settings vtrain prices from --megatron-args: micro-batch groups of the
interleaved schedule and FP8 with its first and last layers in bf16, through the real CLI."""

import json

SMALL = ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
         "--micro-batch-size 2 --vocab-size 1024 --bf16 --tensor-model-parallel-size 1")


def test_microbatch_groups_and_bf16_edge_layers_estimate(run_cli):
    flags = (f"{SMALL} --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
             f"--global-batch-size 40 --microbatch-group-size-per-virtual-pipeline-stage 5 "
             f"--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-end-in-bf16 2")
    proc = run_cli("estimate", "--megatron-args", flags, "--gpu", "H100", "--gpus", "8", "--format", "json", "--no-db")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["iteration_time_ms"] > 0


def test_microbatch_groups_against_megatron_cores_rule_is_one_line(run_cli):
    flags = (f"{SMALL} --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
             f"--global-batch-size 40 --microbatch-group-size-per-virtual-pipeline-stage 4")
    proc = run_cli("estimate", "--megatron-args", flags, "--gpu", "H100", "--gpus", "8", "--no-db")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "training.microbatch_group_size (4) must leave a last group of num_microbatches (5) % 4 = 1" in proc.stderr
