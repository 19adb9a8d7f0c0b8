"""The analytical kernel model against kernels measured alone on a GPU (not a pass/fail test).

    .venv/bin/python -m benchmarks.accuracy.gemm_model [--sweep benchmarks/results/h100_kernel_sweep.csv] [--gpu h100-sxm]

Reads a sweep written by ``gpu_kernel_sweep.py`` on a lent GPU and prints:

1. GEMM: the GEMM efficiency that best fits the bf16 GEMMs on normal inputs (``gemm_efficiency``
   scanned up to the device's measured ceiling; the shape terms, tiles, waves, prologue and split-K,
   as shipped in ``vtrain_plugin.cost.kernels.model``), then the model's error by GEMM size.
2. How the GEMM rate depends on the input values (normal, uniform, zeros): why the profiler draws
   matmul operands from a normal distribution.
3. Streaming kernels: the fraction of HBM bandwidth reached by size, against the model's
   ``bytes / (hbm * hbm_efficiency) + kernel_overhead``.
4. Fused attention (PyTorch's flash backend): the fraction of dense peak forward and backward.
5. Expert GEMMs (``grouped_gemm_sweep.py``'s CSV): one grouped kernel per expert linear, as
   vtrain costs TEGroupedMLP (a batch of the experts' GEMMs), and one GEMM per expert, as it costs
   SequentialMLP, against the model.

Everything uses the KernelModel the estimator uses, with the device's ``default`` calibration for
every constant that is not being scanned.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.cost.kernels.model import KernelBatch, KernelKind, KernelModel, tensor_dtype_code
from vtrain_plugin.hardware.calibration import calibration_for
from vtrain_plugin.hardware.devices import get_device

RESULTS = Path(__file__).resolve().parents[1] / "results"
SIZE_BUCKETS = [0, 1e10, 1e11, 1e12, 1e15]
SIZE_LABELS = ["< 10 GFLOP", "10-100 GFLOP", "0.1-1 TFLOP", "> 1 TFLOP"]


def gemm_batch(frame: pd.DataFrame, dtype: Dtype) -> KernelBatch:
    n = len(frame)
    f = lambda col: frame[col].to_numpy(float)  # noqa: E731
    return KernelBatch(kind=np.full(n, KernelKind.GEMM, np.int8), dtype=np.full(n, tensor_dtype_code(dtype), np.int8),
                       flops=f("flop"), nbytes=f("bytes"), batch=f("batch"), m=f("m"), n=f("n"), k=f("k"),
                       backward=np.zeros(n, bool))


def stream_batch(frame: pd.DataFrame) -> KernelBatch:
    n = len(frame)
    zeros = np.zeros(n)
    return KernelBatch(kind=np.full(n, KernelKind.OTHER, np.int8), dtype=np.zeros(n, np.int8), flops=zeros,
                       nbytes=frame["bytes"].to_numpy(float), batch=zeros, m=zeros, n=zeros, k=zeros,
                       backward=np.zeros(n, bool))


def fit_gemm_efficiency(device, base, batch: KernelBatch, measured_ns: np.ndarray) -> tuple[float, np.ndarray]:
    """The gemm_efficiency (0.5 up to the ceiling, step 0.0025) with the least mean absolute log error."""
    best = None
    for eff in np.arange(0.5, device.gemm_ceiling + 1e-9, 0.0025):
        predicted = KernelModel(device, dataclasses.replace(base, gemm_efficiency=float(eff))).device_ns(batch)
        error = float(np.mean(np.abs(np.log(predicted / measured_ns))))
        if best is None or error < best[0]:
            best = (error, float(eff), predicted)
    return best[1], best[2]


def error_rows(frame: pd.DataFrame, predicted_ns: np.ndarray) -> list[list[str]]:
    ratio = predicted_ns / (frame["median_us"].to_numpy() * 1e3) - 1
    buckets = pd.cut(frame["flop"], SIZE_BUCKETS, labels=SIZE_LABELS)
    groups = [(label, ratio[(buckets == label).to_numpy()]) for label in SIZE_LABELS] + [("all", ratio)]
    return [[label, str(len(r)), f"{100 * np.mean(np.abs(r)):.1f}", f"{100 * np.mean(r):+.1f}",
             f"{100 * np.max(np.abs(r)):.0f}"] for label, r in groups if len(r)]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", type=Path, default=RESULTS / "h100_kernel_sweep.csv")
    parser.add_argument("--gpu", default="h100-sxm", help="device preset the sweep was measured on")
    parser.add_argument("--grouped", type=Path, default=RESULTS / "h100_grouped_gemm.csv",
                        help="expert GEMMs timed by grouped_gemm_sweep.py")
    args = parser.parse_args()
    device = get_device(args.gpu)
    base = calibration_for(device.name, "default").constants
    sweep = pd.read_csv(args.sweep)
    gemm = sweep[(sweep.kind == "gemm") & (sweep.dtype == "bf16") & (sweep["values"] == "normal")]
    aligned = gemm[(gemm.m % 8 == 0) & (gemm.n % 8 == 0) & (gemm.k % 8 == 0)]
    measured = aligned["median_us"].to_numpy() * 1e3
    efficiency, predicted = fit_gemm_efficiency(device, base, gemm_batch(aligned, Dtype.BF16), measured)
    best = gemm.loc[gemm.tflops.idxmax()]
    print(f"{device.name}: {len(aligned)} bf16 GEMMs (dims multiples of 8) on normal inputs; best "
          f"{best.tflops:.1f} TFLOP/s at {best.m}x{best.n}x{best.k} ({best.tflops / device.peak_bf16_tflop_per_s:.3f}"
          f" of peak; public ceiling {device.gemm_ceiling:.3f})")
    print(f"best-fitting gemm_efficiency {efficiency:.4f} (hbm_efficiency {base.hbm_efficiency}, kernel_overhead_ns "
          f"{base.kernel_overhead_ns:g} from the {device.name} default calibration)")
    print(render_table(error_rows(aligned, predicted), ["GEMM size", "GEMMs", "MAPE %", "bias %", "max |err| %"]))
    odd = gemm[(gemm.n % 8 != 0)]
    if len(odd):
        print(f"{len(odd)} GEMMs with N not a multiple of 8 (unaligned rows: no vectorised loads) run at "
              f"{odd.tflops.min():.0f}-{odd.tflops.max():.0f} TFLOP/s; Megatron pads to multiples of 128, the model "
              f"does not cover them")

    values = sweep[(sweep.kind == "gemm") & (sweep.dtype == "bf16")].pivot_table(
        index=["m", "n", "k"], columns="values", values="tflops").dropna()
    if len(values):
        rows = [[f"{m}x{n}x{k}", *(f"{r[c]:.0f}" for c in ("normal", "uniform", "zeros")),
                 f"{100 * (r['uniform'] / r['normal'] - 1):+.1f}"] for (m, n, k), r in values.iterrows()]
        print("\nbf16 GEMM rate (TFLOP/s) by input values")
        print(render_table(rows, ["m x n x k", "normal", "uniform [0,1)", "zeros", "uniform vs normal %"]))

    stream = sweep[(sweep.kind == "stream") & (sweep.dtype == "bf16") & (sweep.op == "copy")]
    if len(stream):
        model = KernelModel(device, base).device_ns(stream_batch(stream))
        rows = [[f"{b / 2**20:,.2f}", f"{t:,.1f}", f"{g / device.hbm_bandwidth_gbytes_per_s:.3f}", f"{p / 1e3:,.1f}",
                 f"{100 * (p / 1e3 / t - 1):+.0f}"]
                for b, t, g, p in zip(stream["bytes"], stream["median_us"], stream["gbps"], model)]
        print("\nstreaming copy (bytes read + written)")
        print(render_table(rows, ["MiB", "measured us", "of HBM peak", "model us", "model err %"]))

    attention = sweep[sweep.kind == "attention"]
    if len(attention):
        rows = [[r.op, f"b{r.batch} h{r.m} s{r.n} d{r.k}", f"{r.tflops:.0f}",
                 f"{r.tflops / device.peak_bf16_tflop_per_s:.3f}"] for r in attention.itertuples()]
        print("\nfused attention, PyTorch flash backend (causal FLOPs)")
        print(render_table(rows, ["kernel", "shape", "TFLOP/s", "of peak"]))

    if args.grouped.exists():
        print("\nexpert GEMMs, bf16 (grouped: torch._grouped_mm, one kernel; loop: one torch.mm per expert)")
        print(render_table(expert_gemm_rows(pd.read_csv(args.grouped), KernelModel(device, base)),
                           ["shape", "GEMM", "experts x m x k x n", "grouped us", "model us", "err %",
                            "loop us", "model us", "err %"]))


def expert_gemm_rows(frame: pd.DataFrame, model: KernelModel) -> list[list[str]]:
    """Each expert GEMM measured as one grouped kernel and as a loop, beside the model's time for
    each: the grouped kernel as a batch of ``experts`` GEMMs, the loop as ``experts`` GEMMs of one."""
    n = len(frame)
    f = lambda col: frame[col].to_numpy(float)  # noqa: E731
    flops = 2 * f("experts") * f("m") * f("k") * f("n")
    nbytes = 2 * f("experts") * (f("m") * f("k") + f("k") * f("n") + f("m") * f("n"))

    def batch(experts: np.ndarray, scale: np.ndarray) -> KernelBatch:
        return KernelBatch(kind=np.full(n, KernelKind.GEMM, np.int8),
                           dtype=np.full(n, tensor_dtype_code(Dtype.BF16), np.int8),
                           flops=flops * scale, nbytes=nbytes * scale, batch=experts, m=f("m"), n=f("n"), k=f("k"),
                           backward=np.zeros(n, bool))

    grouped_us = model.device_ns(batch(f("experts"), np.ones(n))) / 1e3
    loop_us = f("experts") * model.device_ns(batch(np.ones(n), 1 / f("experts"))) / 1e3
    return [[r.shape, r.gemm, f"{r.experts} x {r.m} x {r.k} x {r.n}", f"{r.grouped_us:,.1f}", f"{g:,.1f}",
             f"{100 * (g / r.grouped_us - 1):+.0f}", f"{r.loop_us:,.1f}", f"{lo:,.1f}", f"{100 * (lo / r.loop_us - 1):+.0f}"]
            for r, g, lo in zip(frame.itertuples(), grouped_us, loop_us)]


if __name__ == "__main__":
    main()
