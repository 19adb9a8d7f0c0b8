"""Time the expert GEMMs of today's MoE models on one GPU: one grouped kernel against one GEMM per expert.

    python -m benchmarks.device.grouped_gemm_sweep [--out benchmarks/results/h100_grouped_gemm.csv] [--reps 20]
    python -m benchmarks.device.grouped_gemm_sweep --smoke     # tiny shapes on the CPU: checks the script only

vtrain costs TransformerEngine's ``TEGroupedMLP`` (``--moe-grouped-gemm``) as one grouped-GEMM kernel
per expert linear, tiled as a batch of the experts' GEMMs (:mod:`vtrain_plugin.cost.kernels.model`),
and megatron-core's ``SequentialMLP`` as one GEMM per expert. Neither TransformerEngine nor the
``grouped_gemm`` package installs on the lent GPU machine, so the grouped kernel is PyTorch's
``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper, the kernel torchtitan's MoE runs): the
same work in one launch. Per shape (:data:`SHAPES`: the local experts of one rank of Qwen3
30B-A3B, GPT-OSS 120B, DeepSeek-V3 and the small MoE of ``h100_validation.py``, with balanced
routing), three GEMMs of an expert linear are timed: forward ``(tokens, K) x (K, N)``, the
activation gradient ``(tokens, N) x (N, K)`` and the weight gradient ``(K, tokens) x (tokens, N)``,
each as one grouped kernel and as a loop of per-expert ``torch.mm``; median of ``--reps`` after 3
warm-ups, CUDA events, operands drawn from a normal distribution (see ``profiler/kernel_call.py``).

Writes ``--out`` (CSV, atomically): ``shape, gemm, experts, m, k, n, grouped_us, loop_us,
tflops_grouped`` (``m x k`` by ``k x n`` is one expert's GEMM). ``benchmarks/accuracy/gemm_model.py``-style comparison with the
kernel model is done on any machine afterwards (the CSV holds the shapes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
COLUMNS = ["shape", "gemm", "experts", "m", "k", "n", "grouped_us", "loop_us", "tflops_grouped"]

# name -> (local experts, routed tokens per expert, hidden, expert FFN of one linear's output).
# Tokens per expert: micro-batch 1 x sequence 4096 x top-k / experts x EP ranks sending (balanced).
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b_ep16": (8, 4096, 2048, 768),  # 128 experts top-8, hidden 2048, moe FFN 768
    "gpt-oss-120b_ep8": (16, 1024, 2880, 2880),  # 128 experts top-4, hidden 2880, moe FFN 2880
    "deepseek-v3_ep64": (4, 8192, 7168, 2048),  # 256 experts top-8, hidden 7168, moe FFN 2048
    "small-moe_ep1": (16, 1024, 1024, 768),  # h100_validation.py's moe plan: 16 experts top-4
}
SMOKE_SHAPES = {"tiny": (4, 64, 64, 32)}


def expert_gemms(experts: int, tokens: int, hidden: int, ffn: int) -> list[tuple[str, int, int, int]]:
    """(gemm, M, K, N) of the expert linears: fc1 (gated: 2 x ffn outputs) and fc2, forward,
    activation gradient and weight gradient."""
    fc1, fc2 = (hidden, 2 * ffn), (ffn, hidden)
    rows = []
    for linear, (k, n) in (("fc1", fc1), ("fc2", fc2)):
        rows += [(f"{linear}_fwd", tokens, k, n), (f"{linear}_dgrad", tokens, n, k), (f"{linear}_wgrad", k, tokens, n)]
    return rows


def time_us(fn, reps: int, device) -> float:
    import torch

    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time

        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def measure(name: str, experts: int, tokens: int, hidden: int, ffn: int, reps: int, device) -> list[dict]:
    import torch

    dtype = torch.bfloat16
    rows = []
    for gemm, m, k, n in expert_gemms(experts, tokens, hidden, ffn):
        wgrad = gemm.endswith("wgrad")
        if wgrad:  # (K, tokens of all experts) x (tokens of all experts, N): groups split the inner dim
            a = torch.randn(m, experts * k, device=device, dtype=dtype)
            b = torch.randn(experts * k, n, device=device, dtype=dtype)
            offs = torch.arange(k, experts * k + 1, k, device=device, dtype=torch.int32)
            a_t = a.t().contiguous().t()  # column-major left operand, as the kernel wants for this layout
            grouped = lambda: torch._grouped_mm(a_t, b, offs=offs)
            loop = lambda: [torch.mm(a[:, e * k:(e + 1) * k], b[e * k:(e + 1) * k]) for e in range(experts)]
        else:  # (tokens of all experts, K) x (experts, K, N): groups split the rows
            a = torch.randn(experts * m, k, device=device, dtype=dtype)
            w = torch.randn(experts, n, k, device=device, dtype=dtype)
            b = w.transpose(-2, -1)  # (experts, K, N), column-major: weights are stored (N, K)
            offs = torch.arange(m, experts * m + 1, m, device=device, dtype=torch.int32)
            grouped = lambda: torch._grouped_mm(a, b, offs=offs)
            loop = lambda: [torch.mm(a[e * m:(e + 1) * m], b[e]) for e in range(experts)]
        flops = 2 * experts * m * k * n
        try:
            grouped_us = time_us(grouped, reps, device)
        except (RuntimeError, TypeError) as exc:  # a layout this torch's kernel refuses
            print(f"{name} {gemm}: grouped kernel failed: {str(exc).splitlines()[0]}", file=sys.stderr)
            grouped_us = float("nan")
        loop_us = time_us(loop, reps, device)
        rows.append({"shape": name, "gemm": gemm, "experts": experts, "m": m, "k": k, "n": n, "grouped_us": grouped_us, "loop_us": loop_us,
                     "tflops_grouped": flops / grouped_us / 1e6 if grouped_us == grouped_us else float("nan")})
        print(f"{name:22s} {gemm:10s} grouped {grouped_us:9.1f} us  loop {loop_us:9.1f} us  "
              f"{rows[-1]['tflops_grouped']:6.1f} TFLOP/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "h100_grouped_gemm.csv")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    import pandas as pd
    import torch

    from vtrain_plugin.core.files import atomic_write_text

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows = []
    for name, (experts, tokens, hidden, ffn) in shapes.items():
        rows += measure(name, experts, tokens, hidden, ffn, 2 if args.smoke else args.reps, device)
    atomic_write_text(args.out, pd.DataFrame(rows, columns=COLUMNS).to_csv(index=False, float_format="%.3f"))
    print(f"{len(rows)} GEMMs on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
