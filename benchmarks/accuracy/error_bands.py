"""Write the error-band file: every published run predicted with the shipped constants, and its error.

Estimates each run of the data sets under ``benchmarks/data`` exactly as ``vtrain estimate --no-db``
does (the analytical model, what a user without a GPU gets): vTrain's single- and multi-node A100
runs, SC'21, the NeMo H100 and B200 runs, NVIDIA's Megatron-LM functional tests. Writes each run's
regime, predicted and measured time to ``vtrain_plugin/hardware/data/error_bands.json`` (atomically),
which every estimate reads for its band (:mod:`vtrain_plugin.hardware.error_bands`), with the
provenance: this command, the sha256 of each data file and of each calibration file used. Prints,
per set, MAPE, bias and the share of runs inside their own band, in sample and leave-one-out (the
band of the other runs of the regime: what a new run would see).

Why a script: the bands must be the errors of the constants that ship, so the file is rewritten
whenever a calibration changes (``make error-bands``; a test compares the file's provenance with the
shipped calibration files, and a subset of its rows with what this script computes).

Run with ``.venv/bin/python -m benchmarks.accuracy.error_bands`` (``--sets`` for some of the sets,
``--limit N`` for the first N runs of each, ``--out FILE`` elsewhere than the package).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.accuracy import a100_data, b200_data, h100_data, sc21_data
from benchmarks.accuracy.a100_data import DEFAULT_DATA_DIR

from vtrain_plugin.cli.render import render_table
from vtrain_plugin.core.errors import VTrainError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.calibration import calibration_for, package_calibration_dir
from vtrain_plugin.hardware.clusters import cluster_for_gpu
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.hardware import error_bands as shipped
from vtrain_plugin.hardware.error_bands import ERROR_BANDS_FILE, CalibrationRun, ErrorBands, band_from
from vtrain_plugin.runs import run_config_from_megatron_args
from vtrain_plugin.specs.run import RunConfig

REPO = Path(__file__).resolve().parents[2]
COMMAND = "python -m benchmarks.accuracy.error_bands"
B200_CSV = b200_data.B200_CSV
MEGATRON_CI_CSV = "megatron_ci_calibration.csv"


def _rows(data: Path, name: str) -> list[dict[str, str]]:
    with open(data / name, newline="") as f:
        return list(csv.DictReader(f))


# Each set: (name, data file, reader of (run label, run config factory, measured ms) per run).
Reader = Callable[[Path], list[tuple[str, Callable[[], RunConfig], float]]]


def _measured(which: Callable[[Path], list[a100_data.MeasuredRun]], label: str) -> Reader:
    return lambda data: [(f"{label} row {i + 1}", (lambda m=m: m.run), m.measured_ms)
                         for i, m in enumerate(which(data))]


def _b200(data: Path) -> list[tuple[str, Callable[[], RunConfig], float]]:
    """The B200 runs as the calibration plans them (:func:`benchmarks.accuracy.b200_data.plan_mapping`)."""
    return [(m.name, (lambda m=m: m.run), m.measured_ms) for m in b200_data.read_runs(data)]


def _megatron_ci(data: Path) -> list[tuple[str, Callable[[], RunConfig], float]]:
    return [(f"{row['case']} {row['gpu']}",
             (lambda row=row: run_config_from_megatron_args(row["argv"], gpus=int(row["gpus"]),
                                                            cluster=cluster_for_gpu(row["gpu"]), source=row["case"])),
             float(row["measured_ms"]))
            for row in _rows(data, MEGATRON_CI_CSV) if row.get("status") != "skipped" and row["argv"] and row["gpus"]]


SETS: dict[str, tuple[str, Reader]] = {
    "vtrain_single_node": (a100_data.SINGLE_NODE_CSV,
                           _measured(lambda d: a100_data.read_runs(d, which=("single",)), "single-node")),
    "vtrain_multi_node": (a100_data.MULTI_NODE_CSV,
                          _measured(lambda d: a100_data.read_runs(d, which=("multi",)), "multi-node")),
    "sc21": (sc21_data.SC21_CSV, _measured(sc21_data.read_runs, "SC'21")),
    "nemo_h100": (h100_data.H100_CSV, _measured(h100_data.read_runs, "NeMo H100")),
    "nemo_b200": (B200_CSV, _b200),
    "megatron_ci": (MEGATRON_CI_CSV, _megatron_ci),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _repo_path(path: str | Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


@contextlib.contextmanager
def without_shipped_bands() -> Iterator[None]:
    """Estimates that look up no band: the file this script rewrites (perhaps of an older format,
    which every estimate would refuse) must not stand between the runs and their new errors."""
    shipped._shipped_band.cache_clear()
    try:
        with mock.patch.object(shipped, "ERROR_BANDS_FILE", REPO / "no-error-band-file"):
            yield
    finally:
        shipped._shipped_band.cache_clear()


def predict_sets(sets: Sequence[str], data: Path = DEFAULT_DATA_DIR, limit: int | None = None
                 ) -> tuple[list[CalibrationRun], dict[str, str], list[str]]:
    """Every run of ``sets`` predicted: the runs, the calibration files used (path to sha256) and the
    runs vtrain refuses (``set: run: reason``), left out of the bands."""
    runs: list[CalibrationRun] = []
    calibrations: dict[str, str] = {}
    refused: list[str] = []
    for name in sets:
        _, reader = SETS[name]
        for label, load, measured_ms in reader(data)[:limit]:
            try:
                run = load()
                with without_shipped_bands():
                    est = estimate(run, profile_db=False)
            except VTrainError as exc:
                refused.append(f"{name}: {label}: {exc}")
                continue
            calibration = calibration_for(est.gpu, est.software_stack)
            if not Path(calibration.path).resolve().is_relative_to(package_calibration_dir().resolve()):
                raise SystemExit(f"{calibration.path}: a user's calibration file; the bands are those of the "
                                 f"shipped constants: unset VTRAIN_CALIBRATION_DIR and run again")
            calibrations[_repo_path(calibration.path)] = _sha256(Path(calibration.path))
            runs.append(CalibrationRun(dataset=name, run=label, architecture=get_device(est.gpu).architecture.value,
                                       software_stack=est.software_stack, num_gpus=est.num_gpus,
                                       parameters=est.checkpoint.parameters, num_experts=run.model.num_experts,
                                       predicted_ms=est.iteration_time_ms,
                                       measured_ms=measured_ms))
    return runs, dict(sorted(calibrations.items())), refused


def inside_band(runs: Sequence[CalibrationRun], *, leave_one_out: bool) -> list[bool]:
    """Whether each run's error lies inside its regime's band (from every run, or from the others)."""
    out = []
    for i, run in enumerate(runs):
        others = [r for j, r in enumerate(runs) if j != i] if leave_one_out else runs
        band = band_from(others, run.regime)
        out.append(band is not None and band.low_error_pct <= run.error_pct <= band.high_error_pct)
    return out


def report(runs: Sequence[CalibrationRun]) -> tuple[str, dict[str, dict[str, float]]]:
    """The per-set table (MAPE, bias, share inside its band in sample and leave-one-out) and the same as data."""
    inside, inside_loo = inside_band(runs, leave_one_out=False), inside_band(runs, leave_one_out=True)
    rows, figures = [], {}
    for name in dict.fromkeys(r.dataset for r in runs):
        idx = [i for i, r in enumerate(runs) if r.dataset == name]
        errors = np.array([runs[i].error_pct for i in idx])
        figures[name] = {"runs": len(idx), "mape_pct": float(np.abs(errors).mean()), "bias_pct": float(errors.mean()),
                         "inside_band_pct": 100.0 * sum(inside[i] for i in idx) / len(idx),
                         "inside_band_leave_one_out_pct": 100.0 * sum(inside_loo[i] for i in idx) / len(idx)}
        f = figures[name]
        rows.append([name, str(f["runs"]), f"{f['mape_pct']:.1f}", f"{f['bias_pct']:+.1f}",
                     f"{f['inside_band_pct']:.0f}%", f"{f['inside_band_leave_one_out_pct']:.0f}%"])
    return render_table(rows, ["set", "runs", "MAPE %", "bias %", "inside band", "inside, left out"]), figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    parser.add_argument("--limit", type=int, metavar="N", help="the first N runs of each set only")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", type=Path, default=ERROR_BANDS_FILE)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the runs' own notes and warnings are not the report
    runs, calibrations, refused = predict_sets(args.sets, args.data, args.limit)
    if not runs:
        print(f"error: every run was refused, {args.out} left as it was; the first: {refused[0] if refused else '-'}",
              file=sys.stderr)
        return 2
    table, figures = report(runs)
    provenance = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "estimated_as": "vtrain estimate --no-db (analytical model, shipped calibration files)",
        "data": {_repo_path(args.data / SETS[name][0]): _sha256(args.data / SETS[name][0]) for name in args.sets},
        "calibrations": calibrations, "refused": refused, "sets": figures,
    }
    bands = ErrorBands(provenance=provenance, runs=tuple(runs))
    atomic_write_text(args.out, json.dumps(bands.to_dict(), indent=1) + "\n")
    print(table)
    print(f"{len(runs)} runs written to {args.out}; {len(refused)} refused" + "".join(f"\n  {r}" for r in refused))
    return 0


if __name__ == "__main__":
    sys.exit(main())
