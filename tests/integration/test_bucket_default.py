"""A plan file's default DDP bucket is Megatron-LM's, as on the launch-script path: with
``grad_reduce: overlap`` and no ``bucket_size_mb``, max(4e7, 1e6 x DP) parameters in the gradient dtype."""

import json

from vtrain_plugin.specs.training import default_bucket_elements, default_bucket_size_mb

# 8 layers of 12.6M parameters: 50 MB of fp32 gradients each, so the bucket size decides how the
# DP all-reduce overlaps backward.
FLAGS = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 "
         "--vocab-size 1024 --overlap-grad-reduce --bf16")


def test_megatron_default_bucket_rule():
    assert default_bucket_elements(8) == 40_000_000
    assert default_bucket_elements(64) == 64_000_000
    assert default_bucket_size_mb(64, 4) == 256.0 and default_bucket_size_mb(8, 2) == 80.0


def test_plan_file_and_megatron_args_give_the_same_buckets_and_estimate(tmp_path, run_cli):
    args = ("--megatron-args", FLAGS, "--gpus", "64", "--gpu", "H100", "--no-db")
    megatron = json.loads(run_cli("estimate", *args, "--format", "json", check=True).stdout)
    # bf16 model, fp32 gradients, DP 64: 64e6 parameters x 4 bytes
    assert megatron["plan"]["training"]["bucket_size_mb"] == 256.0
    plan = megatron["plan"]
    plan["training"]["bucket_size_mb"] = None  # the plan file gives none: the default
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    from_file = json.loads(run_cli("estimate", str(path), "--no-db", "--format", "json", check=True).stdout)
    assert from_file["plan"]["training"]["bucket_size_mb"] is None
    for key in ("iteration_time_ms", "breakdown_ms", "peak_memory_gib"):
        assert from_file[key] == megatron[key], key
    table = [run_cli("estimate", *source, check=True).stdout.splitlines()[4] for source in (args, (str(path), "--no-db"))]
    assert all("gradient reduction overlap (buckets 256 MB, gradients in fp32)" in line for line in table), table
    # the old plan-file default, 40 MB, reduces in more, smaller buckets: a different estimate
    plan["training"]["bucket_size_mb"] = 40
    path.write_text(json.dumps(plan))
    old = json.loads(run_cli("estimate", str(path), "--no-db", "--format", "json", check=True).stdout)
    assert old["breakdown_ms"]["dp_comm"] != megatron["breakdown_ms"]["dp_comm"]
