"""One plan, one answer per GPU: the same bf16 plan under the same software stack is never slower
on a newer GPU (B200 <= H200 <= H100 <= A100 in iteration time).

Every estimate is a real traced megatron-core model, costed on each GPU's preset node with the
shipped calibration. The H200 is the H100's die with faster HBM, the B200 more of everything, the
H100 more of everything than the A100; and the host costs belong to the software stack, not to
the GPU (:data:`vtrain_plugin.hardware.calibration.SOFTWARE_CONSTANTS`). No plan of the grid needs
an exception (a plan that runs out of memory on the smaller GPU is still timed: the order is of
time, and memory is the same 80 GB on A100 and H100). The tolerance is float rounding only: a
host-bound plan takes the same time on every GPU.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest

from vtrain_plugin.runs import load_run_config, run_config_from_dict, with_gpu
from vtrain_plugin.estimate import estimate

GPUS = ("a100-sxm4-80gb", "h100-sxm", "h200-sxm", "b200-sxm")  # slowest first
STACK = "megatron_core_te"

_GPT_TINY = {"name": "gpt-tiny", "family": "gpt", "num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
             "seq_length": 512, "vocab_size": 8192, "dtype": "bf16"}
_GPT_1B = {"name": "gpt-1.3b", "family": "gpt", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
           "seq_length": 2048, "vocab_size": 50257, "dtype": "bf16"}
_LLAMA_SMALL = {"name": "llama-small", "family": "llama", "num_layers": 8, "hidden_size": 1024,
                "num_attention_heads": 16, "num_query_groups": 4, "ffn_hidden_size": 2816, "seq_length": 4096,
                "vocab_size": 32000, "dtype": "bf16"}


def _plan(model: dict[str, Any], global_batch: int, **parallel: Any) -> dict[str, Any]:
    training = {"global_batch_size": global_batch, "software_stack": STACK}
    if parallel.get("virtual_pipeline", 1) > 1:
        training["schedule"] = "interleaved_1f1b"
    return {"model": model, "parallel": parallel, "training": training, "cluster": {"preset": "dgx-a100"}}


# Tiny to 70B, GPT and Llama-style; TP, PP (plain and interleaved), DP, micro-batch and recompute varied.
PLANS = {
    "gpt_tiny_1gpu": _plan(_GPT_TINY, 8, micro_batch_size=4),
    "gpt_1b_dp8_mb4": _plan(_GPT_1B, 512, data_parallel=8, micro_batch_size=4),
    "gpt_1b_dp8_mb1_full_recompute": _plan(_GPT_1B, 512, data_parallel=8, micro_batch_size=1, recompute="full"),
    "gpt_1b_tp2_pp2_dp4": _plan(_GPT_1B, 64, tensor_parallel=2, pipeline_parallel=2, data_parallel=4,
                                micro_batch_size=2),
    "gpt_1b_tp8_sp_selective": _plan(_GPT_1B, 16, tensor_parallel=8, sequence_parallel=True, micro_batch_size=2,
                                     recompute="selective"),
    "llama_small_tp2_pp2_vp2_dp16": _plan(_LLAMA_SMALL, 128, tensor_parallel=2, sequence_parallel=True,
                                          pipeline_parallel=2, virtual_pipeline=2, data_parallel=16,
                                          micro_batch_size=1),
    "llama_small_pp4_full_recompute": _plan(_LLAMA_SMALL, 32, pipeline_parallel=4, data_parallel=2,
                                            micro_batch_size=2, recompute="full"),
}
LLAMA3_70B = "examples/configs/llama3_70b_256gpu_bf16.yaml"  # TP 4, PP 4 x 5 virtual, DP 16: 256 GPUs
NAMES = [*sorted(PLANS), "llama3_70b_256gpu_bf16"]


@lru_cache(maxsize=None)
def _times(name: str) -> dict[str, float]:
    """Iteration time in ms of the plan ``name`` on every GPU of :data:`GPUS`."""
    run = load_run_config(LLAMA3_70B) if name == "llama3_70b_256gpu_bf16" else run_config_from_dict(PLANS[name],
                                                                                                      source=name)
    estimates = {gpu: estimate(with_gpu(run, gpu)) for gpu in GPUS}
    assert {e.software_stack for e in estimates.values()} == {STACK}
    return {gpu: e.iteration_time_ms for gpu, e in estimates.items()}


@pytest.mark.parametrize("name", NAMES)
def test_a_newer_gpu_is_never_slower(name):
    times = _times(name)
    for slower, faster in zip(GPUS, GPUS[1:]):
        assert times[faster] <= times[slower] * (1 + 1e-12), (name, slower, faster, times)


@pytest.mark.parametrize("name", NAMES)
def test_h200_is_the_h100_with_faster_memory(name):
    """Same GH100 die and constants: the H200 gains at most what its HBM gives memory-bound
    kernels (4800 / 3350), nothing on compute-bound or host-bound work."""
    times = _times(name)
    assert 1.0 <= times["h100-sxm"] / times["h200-sxm"] <= 4800 / 3350
