"""Every input path (plan file, launch script, --megatron-args, Megatron-Bridge ConfigContainer YAML,
Python API) gives the same estimate for the same run, through every command that takes it; the
input bugs of issue 31 item 5 stay fixed (real CLI in a subprocess)."""

import json
from pathlib import Path

from vtrain_plugin import Hardware, estimate, load_run
from vtrain_plugin.cli.estimate import plan_document

BRIDGE = str(Path(__file__).resolve().parents[1] / "fixtures" / "bridge" / "gpt_tiny_run_config.yaml")
# The run of the Bridge fixture, as Megatron-LM arguments written by hand.
FLAGS = ("--num-layers 2 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 256 --vocab-size 1024 --micro-batch-size 1 --global-batch-size 16 "
         "--tensor-model-parallel-size 2 --sequence-parallel --normalization RMSNorm --swiglu --disable-bias-linear "
         "--untie-embeddings-and-output-weights --position-embedding-type rope --hidden-dropout 0.0 "
         "--attention-dropout 0.0 --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
         "--cross-entropy-loss-fusion --ddp-average-in-collective --save /results/checkpoints --save-interval 500")
HARDWARE = ("--gpu", "H100", "--gpus-per-node", "4")  # two trays of 4: the DP all-reduce crosses nodes


def _plan_file(tmp_path: Path) -> Path:
    """The Bridge run as a plan file: every field the estimate read, written back."""
    run = load_run(BRIDGE, gpus=8, hardware=Hardware(gpu="H100", gpus_per_node=4))
    document = plan_document(run)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    return path


def _same_estimate(documents: list[dict]) -> list[dict]:
    return [{k: d[k] for k in d if k != "config"} for d in documents]


def test_every_input_path_gives_the_same_estimate(tmp_path, run_cli):
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/bash\nARGS=\"{FLAGS}\"\ntorchrun --nnodes 2 --nproc-per-node 4 pretrain_gpt.py $ARGS\n")
    megatron = run_cli("estimate", str(script), BRIDGE, "--megatron-args", FLAGS, "--gpus", "8", *HARDWARE,
                       "--format", "jsonl", check=True)
    plan = run_cli("estimate", str(_plan_file(tmp_path)), *HARDWARE, "--format", "jsonl", check=True)
    documents = [json.loads(line) for line in (megatron.stdout + plan.stdout).splitlines()]
    assert [d["config"] for d in documents] == [str(script), BRIDGE, "--megatron-args", str(tmp_path / "plan.json")]
    first, *others = _same_estimate(documents)
    assert all(other == first for other in others)
    assert first["num_gpus"] == 8 and first["gpu"] == "h100-sxm" and first["plan"]["cluster"]["gpus_per_node"] == 4
    python = estimate(load_run(BRIDGE, gpus=8, hardware=Hardware(gpu="H100", gpus_per_node=4)))
    assert python.iteration_time_ms == first["iteration_time_ms"]
    assert python.peak_memory_gib == first["peak_memory_gib"]


def test_search_takes_every_input_path_alike(tmp_path, run_cli):
    space = ("--gpus", "8", "--tp", "2", "--pp", "1", "--micro-batch", "1", *HARDWARE, "--format", "jsonl",
             "--workers", "1")
    rows = [run_cli("search", *given, *space, check=True).stdout
            for given in ((BRIDGE,), ("--megatron-args", FLAGS), (str(_plan_file(tmp_path)),))]
    assert rows[0] and rows[0] == rows[1] == rows[2]


def test_the_input_bugs_stay_fixed(tmp_path, run_cli):
    script = tmp_path / "train.sh"
    script.write_text(f"torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py {FLAGS} --fp8-format hybrid\n")
    # calibrate has --gpu (argparse no longer reads it as --gpus); a GPU without fp8 is refused before tracing
    fp8 = run_cli("calibrate", "--gpu", "A100", "--from-runs", "run.log", "--plan", str(script), "--dry-run")
    assert fp8.returncode == 2
    assert fp8.stderr.splitlines()[-1:] == [
        f"vtrain: error: {script}: training.fp8 'hybrid' needs fp8 tensor cores; a100-sxm4-80gb (ampere) has none "
        f"(these have: {_fp8_gpus()}); --gpu a100-sxm4-80gb: choose one with --gpu"]
    default = run_cli("estimate", str(script), "--format", "json")
    assert default.returncode == 2
    assert default.stderr.splitlines()[-1].endswith("no --gpu given: choose one with --gpu")
    abbreviated = run_cli("search", BRIDGE, "--gp", "H100", "--gpus", "8")
    assert abbreviated.returncode == 2 and "unrecognized arguments: --gp H100" in abbreviated.stderr
    unknown = tmp_path / "run_config.yaml"
    unknown.write_text(Path(BRIDGE).read_text().replace("  num_layers: 2\n", "  num_layers: 2\n  heterogeneous_block_specs: true\n"))
    refused = run_cli("estimate", str(unknown), "--gpus", "8")
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"vtrain: error: {unknown}: model.heterogeneous_block_specs true: not a setting vtrain reads (it may change "
        f"speed or memory); leave it at its default"]


def _fp8_gpus() -> str:
    from vtrain_plugin.hardware.devices import _load, known_devices

    return ", ".join(n for n in known_devices() if _load(n).has_fp8)
