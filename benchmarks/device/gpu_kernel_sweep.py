"""Ground truth for the kernel model on a lent GPU: GEMM rate by shape, dtype and input values,
streaming bandwidth by size, and flash attention, each timed alone.

    python -m benchmarks.device.gpu_kernel_sweep [--out benchmarks/results/h100_kernel_sweep.csv] [--quick]

Writes one CSV (atomically) with a row per measurement: ``kind`` (gemm, stream, attention),
``dtype``, ``values`` (how the inputs were drawn: ``normal`` N(0, 1) as weights and activations
are in training, ``uniform`` U[0, 1) as the profiler's replay draws them, ``zeros``), the shape
(``m, n, k, batch``; attention: ``batch, heads, seq, head_dim`` in ``m, n, k`` order: heads in m,
seq in n, head_dim in k), ``flop`` and ``bytes`` (the fewest HBM bytes: each operand once),
``median_us`` and ``p10_us``/``p90_us`` over the repetitions, and the derived ``tflops`` and
``gbps``. Why each part:

- GEMM over a grid of training shapes (tokens x hidden, TP splits, vocab), square sizes, tile
  probes (N around multiples of 128 and 256), wave probes (M in steps of one 128-row tile) and
  thin GEMMs (the memory-bound regime): the shape terms of ``cost.kernel_model``'s GEMM model.
- the same GEMMs with normal, uniform and zero inputs: a tensor core's power, hence its clock,
  depends on the bits it multiplies, so a replay on values unlike training's mis-times it.
- streaming kernels (copy, add, fused multiply-add) from 64 KiB to 2 GiB: the fraction of HBM
  bandwidth by size (launch-bound below ~1 MB, near peak above ~100 MB).
- ``scaled_dot_product_attention`` (flash backend) forward and backward at training shapes.

Every repetition is preceded by a write over twice the L2 cache, and inputs are rotated over enough
copies to exceed it, so no timing is an L2 hit. Needs a CUDA device and PyTorch only.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
COLUMNS = ["kind", "op", "dtype", "values", "batch", "m", "n", "k", "flop", "bytes", "median_us", "p10_us",
           "p90_us", "tflops", "gbps"]


class Timer:
    """Median device time of a call with the L2 flushed before each repetition (CUDA events)."""

    def __init__(self, device: torch.device, budget_s: float = 0.03, min_reps: int = 10, max_reps: int = 200):
        self.flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8,
                                 device=device)
        self.budget_s, self.min_reps, self.max_reps = budget_s, min_reps, max_reps

    def __call__(self, calls: list) -> list[float]:
        for call in calls[:3]:
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        calls[0]()
        torch.cuda.synchronize()
        once = max(time.perf_counter() - start, 1e-6)
        reps = max(self.min_reps, min(self.max_reps, int(self.budget_s / once)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (a, b) in enumerate(events):
            self.flush.zero_()
            a.record()
            calls[i % len(calls)]()
            b.record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in events]


def _draw(shape, dtype, values, device):
    if values == "zeros":
        return torch.zeros(shape, device=device, dtype=dtype)
    if values == "uniform":
        return torch.rand(shape, device=device, dtype=torch.float32).to(dtype)
    return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)


def _copies(nbytes: int, l2: int) -> int:
    return max(1, min(8, math.ceil(3 * l2 / max(nbytes, 1))))


def _row(kind, op, dtype, values, batch, m, n, k, flop, nbytes, samples):
    med = statistics.median(samples)
    q = statistics.quantiles(samples, n=10) if len(samples) >= 10 else [min(samples)] * 9
    return {"kind": kind, "op": op, "dtype": dtype, "values": values, "batch": batch, "m": m, "n": n, "k": k,
            "flop": flop, "bytes": nbytes, "median_us": round(med, 3), "p10_us": round(q[0], 3),
            "p90_us": round(q[-1], 3), "tflops": round(flop / med / 1e6, 2) if flop else 0.0,
            "gbps": round(nbytes / med / 1e3, 1)}


def gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    shapes: set[tuple[int, int, int]] = set()
    for s in (256, 512, 1024, 2048, 4096, 8192, 16384):
        shapes.add((s, s, s))
    hiddens = (2048, 4096, 8192) if quick else (1024, 2048, 4096, 5120, 8192, 12288)
    for tokens in ((4096, 16384) if quick else (2048, 4096, 8192, 16384)):
        for h in hiddens:
            for tp in (1, 2, 4, 8):
                shapes.add((tokens, 3 * h // tp, h))  # QKV forward
                shapes.add((tokens, h, h // tp))  # attention output forward
                shapes.add((tokens, 4 * h // tp, h))  # fc1 forward
                shapes.add((tokens, h, 4 * h // tp))  # fc2 forward
                shapes.add((h, 4 * h // tp, tokens))  # fc1 weight gradient
    for n in (4096, 4097, 4160, 4223, 4224, 4225, 4288, 4352, 4353, 4480, 4608):  # tile probes
        shapes.add((8192, n, 4096))
    for tiles in range(8, 160, 4 if quick else 2):  # wave probes: M in 128-row tiles, one N tile column of 256
        shapes.add((128 * tiles, 4096, 4096))
    for thin in (16, 32, 64, 128, 256):  # memory-bound GEMMs
        shapes.add((16384, thin, 4096))
        shapes.add((16384, 4096, thin))
    for vocab in (32000, 50304, 128256):
        shapes.add((8192, vocab // 8, 8192))
        shapes.add((4096, vocab, 4096))
    return sorted(shapes)


def sweep_gemm(timer: Timer, device, quick: bool, l2: int) -> list[dict]:
    rows = []
    shapes = gemm_shapes(quick)
    value_probe = {(8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 4096), (2048, 2048, 2048),
                   (16384, 16384, 16384), (4096, 12288, 4096), (8192, 6272, 8192)}
    for i, (m, n, k) in enumerate(shapes):
        nbytes = 2 * (m * k + k * n + m * n)
        for values in (("normal", "uniform", "zeros") if (m, n, k) in value_probe else ("normal",)):
            copies = _copies(nbytes, l2)
            ops = [(_draw((m, k), torch.bfloat16, values, device), _draw((k, n), torch.bfloat16, values, device))
                   for _ in range(copies)]
            samples = timer([lambda a=a, b=b: torch.mm(a, b) for a, b in ops])
            rows.append(_row("gemm", "mm", "bf16", values, 1, m, n, k, 2 * m * n * k, nbytes, samples))
            del ops
        if hasattr(torch, "_scaled_mm") and (m % 16 == 0 and n % 16 == 0 and k % 16 == 0) and i % 2 == 0:
            try:
                one = torch.ones((), device=device)
                ops = [(_draw((m, k), torch.bfloat16, "normal", device).to(torch.float8_e4m3fn),
                        _draw((n, k), torch.bfloat16, "normal", device).to(torch.float8_e4m3fn).t())
                       for _ in range(_copies(nbytes // 2, l2))]
                samples = timer([lambda a=a, b=b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
                                 for a, b in ops])
                rows.append(_row("gemm", "scaled_mm", "fp8_e4m3", "normal", 1, m, n, k, 2 * m * n * k,
                                 m * k + k * n + 2 * m * n, samples))
                del ops
            except (RuntimeError, TypeError) as exc:
                print(f"fp8 {m}x{n}x{k}: {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr)
        if i % 20 == 0:
            print(f"gemm {i + 1}/{len(shapes)}", file=sys.stderr, flush=True)
    return rows


def sweep_stream(timer: Timer, device, l2: int) -> list[dict]:
    rows = []
    for log2 in range(16, 32, 1):
        nbytes = 2 ** log2
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            numel = nbytes // dtype.itemsize
            copies = _copies(3 * nbytes, l2)
            xs = [(torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype))
                  for _ in range(copies)]
            outs = [torch.empty(numel, device=device, dtype=dtype) for _ in range(copies)]
            samples = timer([lambda x=x, o=o: o.copy_(x[0]) for x, o in zip(xs, outs)])
            rows.append(_row("stream", "copy", name, "normal", 1, numel, 0, 0, 0, 2 * nbytes, samples))
            samples = timer([lambda x=x, o=o: torch.add(x[0], x[1], out=o) for x, o in zip(xs, outs)])
            rows.append(_row("stream", "add", name, "normal", 1, numel, 0, 0, numel, 3 * nbytes, samples))
            samples = timer([lambda x=x: x[0].mul_(0.999) for x in xs])
            rows.append(_row("stream", "mul_", name, "normal", 1, numel, 0, 0, numel, 2 * nbytes, samples))
            del xs, outs
    return rows


def sweep_attention(timer: Timer, device, quick: bool) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    cases = [(b, h, s, d) for (b, h, s, d) in
             [(1, 16, 2048, 64), (2, 16, 2048, 64), (4, 16, 2048, 128), (1, 32, 4096, 128), (2, 32, 4096, 128),
              (1, 64, 4096, 128), (1, 16, 8192, 128), (1, 8, 8192, 128), (8, 16, 1024, 64), (1, 96, 2048, 128),
              (1, 24, 2048, 96)]]
    for b, h, s, d in cases[: 5 if quick else None]:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)
        flop_fwd = 4 * b * h * s * s * d // 2  # causal: half the score matrix
        nbytes = 4 * 2 * b * h * s * d
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                fwd = timer([lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)])
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def backward():
                    torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
                bwd = timer([backward])
        except RuntimeError as exc:
            print(f"attention {b, h, s, d}: {str(exc).splitlines()[0]}", file=sys.stderr)
            continue
        rows.append(_row("attention", "flash_fwd", "bf16", "normal", b, h, s, d, flop_fwd, nbytes, fwd))
        rows.append(_row("attention", "flash_bwd", "bf16", "normal", b, h, s, d, int(2.5 * flop_fwd),
                         2 * nbytes, bwd))
        del q, k, v, grad, out
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "h100_kernel_sweep.csv")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (about a minute)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernel_sweep: needs a CUDA device (none is visible)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB, "
          f"torch {torch.__version__}", file=sys.stderr, flush=True)
    timer = Timer(device)
    rows = []
    for part in (lambda: sweep_gemm(timer, device, args.quick, props.L2_cache_size),
                 lambda: sweep_stream(timer, device, props.L2_cache_size),
                 lambda: sweep_attention(timer, device, args.quick)):
        rows += part()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(buf.getvalue())
        os.replace(tmp, args.out)  # written after every part: a run stopped at a limit keeps what it finished
    best = max((r for r in rows if r["kind"] == "gemm" and r["dtype"] == "bf16" and r["values"] == "normal"),
               key=lambda r: r["tflops"])
    print(f"{len(rows)} measurements; best bf16 GEMM on normal inputs {best['tflops']:.1f} TFLOP/s at "
          f"{best['m']}x{best['n']}x{best['k']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
