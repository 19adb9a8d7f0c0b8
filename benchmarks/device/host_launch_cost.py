"""What one eager op costs the host, on a GPU machine: issue time per op for small PyTorch ops, and
the device time of the same ops when the host is not the limit (and a GEMM whose row count changes
every call, as an MoE expert's does).

    python -m benchmarks.device.host_launch_cost [--out PATH] [--ops 20000]

An eager training step (megatron-core's local spec, or any stack that is not one fused kernel per
layer) issues thousands of small ops per micro-batch; each costs the host Python, the ATen
dispatcher and a kernel launch, and when that exceeds the op's device time the GPU waits. For each
op kind below, ``--ops`` ops are issued back to back on tensors already on the device: ``host_us``
is the wall time of issuing them divided by their number (the queue never fills at these counts,
so issue is not throttled), ``wall_us`` the same up to the device finishing them. Rows are written
to ``--out`` (CSV, atomically) and printed. Needs a CUDA device and PyTorch only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _cases(torch, device, ops: int):
    import itertools

    small = torch.randn(1024, device=device, dtype=torch.bfloat16)
    act = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
    weight = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    linear = torch.nn.Linear(1024, 1024, bias=False, device=device, dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(1024, device=device, dtype=torch.bfloat16)
    # An MoE expert's GEMM: its rows are the tokens routed to it, a new count each micro-batch; here a
    # new M on every call, so cuBLAS meets each shape once (the warm-up included).
    tokens = torch.randn(1024 + ops + 200, 1024, device=device, dtype=torch.bfloat16)
    rows = itertools.count(1024)
    return {
        "add (1 Ki elements)": lambda: small.add(small),
        "mul (4 Mi elements)": lambda: act.mul(act),
        "to fp32 (4 Mi elements)": lambda: act.float(),
        "matmul 4096x1024x1024": lambda: act @ weight,
        "matmul Mx1024x1024, M new each call (1024 up)": lambda: tokens[:next(rows)] @ weight,
        "nn.Linear module call 4096x1024x1024": lambda: linear(act),
        "nn.LayerNorm module call 4096x1024": lambda: norm(act),
    }


def measure(ops: int) -> list[dict]:
    import torch

    device = torch.device("cuda")
    rows = []
    for name, op in _cases(torch, device, ops).items():
        for _ in range(200):  # warm-up: allocator pools, cuBLAS handles, kernel selection
            op()
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(ops):
            op()
        issued = time.perf_counter_ns()
        torch.cuda.synchronize()
        done = time.perf_counter_ns()
        rows.append({"op": name, "ops": ops, "host_us": (issued - start) / ops / 1e3,
                     "wall_us": (done - start) / ops / 1e3})
    return rows


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    import platform

    import pandas as pd
    import torch

    from vtrain_plugin.core.files import atomic_write_text

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ops", type=int, default=20000)
    args = parser.parse_args(argv)
    frame = pd.DataFrame(measure(args.ops))
    frame["gpu"] = torch.cuda.get_device_name()
    frame["cpu"] = _cpu_name() or platform.machine()
    frame["torch"] = torch.__version__
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if args.out is not None:
        atomic_write_text(args.out, frame.to_csv(index=False, float_format="%.3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
