"""Megatron-LM's fine-grained activation offloading flags read as TrainingSpec.activation_offload, the
one-line refusals, and the real CLI estimating a small run with them (offloading lowers peak memory,
never the iteration time)."""

from __future__ import annotations

import json

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.activation_offload import ActivationOffload
from vtrain_plugin.specs.megatron.args import parse_flags
from vtrain_plugin.specs.megatron.offload_args import activation_offload

ON = ["--fine-grained-activation-offloading"]


def _read(*argv: str, notes: list[str] | None = None):
    return activation_offload(parse_flags(list(argv)), [] if notes is None else notes)


def test_flags_set_the_settings():
    notes: list[str] = []
    got = _read(*ON, "--offload-modules", "[expert_fc1", "moe_act", "core_attn", "attn_proj]",
                "--activation-offload-fraction", "0.5", "--min-offloaded-tensor-size", "4096",
                "--fine-grained-offloading-max-inflight-offloads", "2", notes=notes)
    assert got == ActivationOffload(modules=("expert_fc1", "moe_act", "core_attn", "attn_proj"), fraction=0.5,
                                    min_tensor_elements=4096)
    assert notes == ["--fine-grained-offloading-max-inflight-offloads 2"]
    assert _read("--min-offloaded-tensor-size", str(1024 * 1024)) is None  # Megatron-LM's default alone


@pytest.mark.parametrize("argv, message", [
    (["--offload-modules", "core_attn"], "--offload-modules needs --fine-grained-activation-offloading"),
    (ON, "needs --offload-modules"),
    (ON + ["--offload-modules", "attn_proj"], "attn_proj needs core_attn"),
    (ON + ["--offload-modules", "mlp"], "must be one of"),
    (ON + ["--offload-modules", "core_attn", "--activation-offload-fraction", "0"], "must lie in"),
    (ON + ["--offload-modules", "core_attn", "--delta-offload-bytes-across-pp-ranks", "1000"],
     "not modelled by vtrain yet"),
])
def test_bad_flags_are_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError, match=message) as err:
        _read(*argv)
    assert "\n" not in str(err.value)


ARGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 4096 --max-position-embeddings 4096 "
        "--micro-batch-size 2 --global-batch-size 16 --bf16 --vocab-size 256")


def _estimate(python_m, argv: str) -> dict:
    proc = python_m("vtrain_plugin.cli", "estimate", "--megatron-args", argv, "--gpu", "H100", "--gpus", "8",
                    "--format", "json", "--no-db")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cli_estimates_offloading_with_less_memory_and_no_less_time(python_m):
    base = _estimate(python_m, ARGS)
    off = _estimate(python_m, ARGS + " --fine-grained-activation-offloading --offload-modules qkv_linear core_attn "
                                     "attn_proj --min-offloaded-tensor-size 1024")
    assert off["peak_memory_gib"] < base["peak_memory_gib"]
    assert off["iteration_time_ms"] >= base["iteration_time_ms"]
    assert any("activation offloading" in line for line in off["assumptions"])
