"""NVIDIA's Megatron-LM functional-test runs (small models on DGX A100 / H100, today's stack) as runs.

Shared by ``calibrate.py`` and ``published_runs.py``. Each row of
``benchmarks/data/megatron_ci_calibration.csv`` is one test case on one GPU: its Megatron-LM arguments as
published (paths and logging removed), read exactly as ``vtrain estimate --megatron-args`` reads them
(``megatron_ci_check.py`` asks the CLI the same), on the GPU's usual 8-GPU node; the measured time is
the median iteration time of the test's golden values. A run's name is its test case and GPU; the
runs of ``--deterministic-mode`` (their kernels and NCCL's ring differ) are the plans whose
``training.deterministic`` is set.
"""

from __future__ import annotations

import csv
from pathlib import Path

from benchmarks.accuracy.a100_data import DEFAULT_DATA_DIR, MeasuredRun

CI_CSV = "megatron_ci_calibration.csv"
GPUS = {"A100": "a100-sxm4-80gb", "H100": "h100-sxm"}


def read_runs(data_dir: Path = DEFAULT_DATA_DIR) -> list[MeasuredRun]:
    with open(data_dir / CI_CSV, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("status") != "skipped" and r["argv"] and r["gpus"]]
    return [MeasuredRun(source="ci", config={"megatron_args": r["argv"], "gpus": int(r["gpus"]), "gpu": GPUS[r["gpu"]]},
                        measured_ms=float(r["measured_ms"]), name=f"{r['case']} ({r['gpu']})") for r in rows]


def read_env(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, str]:
    """The environment variables each run's test set (``env_vars``, e.g.
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``), by :func:`read_runs`'s run name: not an input of the
    estimate (its command line has no environment), a diagnostic of the residuals."""
    with open(data_dir / CI_CSV, newline="") as f:
        return {f"{r['case']} ({r['gpu']})": r["env_vars"] for r in csv.DictReader(f)}


def test_case_of(name: str) -> str:
    """The test case of a run's name (its A100 and H100 runs are one case)."""
    return name.rsplit(" (", 1)[0]


def read_memory(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, tuple[str, float]]:
    """The test family (``gpt``, ``moe``) and ``mem-max-allocated-bytes`` in GiB of each run that
    logged it, by :func:`read_runs`'s run name: ``max allocated`` of the last rank (with PP > 1, of
    the last pipeline stage)."""
    with open(data_dir / CI_CSV, newline="") as f:
        return {f"{r['case']} ({r['gpu']})": (r["family"], float(r["measured_mem_gib"]))
                for r in csv.DictReader(f) if r.get("measured_mem_gib")}
