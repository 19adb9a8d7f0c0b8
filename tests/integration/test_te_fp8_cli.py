"""The TE stack and FP8 through the real CLI: estimate and search on H100, one-line errors on A100."""

import json

import yaml

PLAN = {
    "model": {"name": "llama-tiny", "family": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
              "num_query_groups": 4, "seq_length": 128, "vocab_size": 1024, "dtype": "bf16"},
    "parallel": {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 2, "sequence_parallel": True,
                 "micro_batch_size": 1},
    "training": {"global_batch_size": 8, "fp8": "hybrid"},
    "cluster": {"preset": "dgx-h100"},
}
NO_FP8 = ("training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb (ampere) has none "
          "(these have: b200-sxm, gb200, gb300, h100-sxm, h200-sxm)")


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_fp8_estimate_on_h100_names_its_stack_and_precision(tmp_path, run_cli):
    path = write(tmp_path, "fp8.yaml", PLAN)
    table = run_cli("estimate", path, check=True).stdout
    assert table.splitlines()[4].endswith("stack megatron_core_te, fp8 hybrid (delayed scaling)")
    row = json.loads(run_cli("estimate", path, "--format", "jsonl", check=True).stdout)
    assert (row["software_stack"], row["fp8"], row["gpu"]) == ("megatron_core_te", "hybrid", "h100-sxm")
    bf16 = json.loads(run_cli("estimate", write(tmp_path, "bf16.yaml", {**PLAN, "training": {"global_batch_size": 8}}),
                              "--format", "jsonl", check=True).stdout)
    assert (bf16["software_stack"], bf16["fp8"]) == ("megatron_core_te", None)  # Llama's default stack


def test_fp8_on_a100_is_one_line_exit_2(tmp_path, run_cli):
    path = write(tmp_path, "fp8.yaml", PLAN)
    for args, message in ((("estimate", path, "--gpu", "A100"), f"{path}: {NO_FP8}; --gpu A100: choose one with --gpu"),
                          (("estimate", write(tmp_path, "a100.yaml", {**PLAN, "cluster": {"preset": "dgx-a100"}})),
                           f"{tmp_path / 'a100.yaml'}: {NO_FP8}; the GPU is cluster.gpu of the plan"),
                          (("search", path, "--gpus", "8", "--gpu", "A100", "--tp", "2", "--pp", "2"),
                           NO_FP8.replace("training.fp8", "fp8"))):
        proc = run_cli(*args)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip().splitlines() == [f"vtrain: error: {message}"], proc.stderr


def test_search_pins_fp8_and_reports_the_stack_of_each_plan(tmp_path, run_cli):
    path = write(tmp_path, "fp8.yaml", PLAN)
    proc = run_cli("search", path, "--gpus", "8", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--vp", "1",
                   "--sp", "on", "--recompute", "none", "--grad-reduce", "overlap", "--dist-opt", "off",
                   "--fp8", "off,hybrid", "--format", "jsonl", "--workers", "1", check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted((r["software_stack"], r["fp8"] or "off") for r in rows) == [("megatron_core_te", "hybrid"),
                                                                             ("megatron_core_te", "off")]
    table = run_cli("search", path, "--gpus", "8", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--vp", "1",
                    "--sp", "on", "--recompute", "none", "--grad-reduce", "overlap", "--dist-opt", "off",
                    "--fp8", "off,hybrid", "--workers", "1", check=True).stdout
    assert table.splitlines()[0].split()[:14] == ["rank", "tp", "cp", "pp", "dp", "mb", "vp", "sp", "recompute",
                                                  "grad", "reduce", "dist", "opt", "fp8"]
