"""Error bands: the regime of a run, the band of a regime (exact percentiles, widening, far from
calibration, dense and MoE kept apart), and the shipped file's schema and provenance against the data
and calibration files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.calibration import package_calibration_dir
from vtrain_plugin.hardware.error_bands import (ERROR_BANDS_FILE, FORMAT_VERSION, NO_MOE_RUN, CalibrationRun,
                                                band_from, read_error_bands, regime_of)

REPO = Path(__file__).resolve().parents[3]


def _run(error_pct: float, *, gpus: int = 8, parameters: float = 5e8, architecture: str = "ampere",
         stack: str = "megatron_core_te", experts: int | None = None) -> CalibrationRun:
    return CalibrationRun(dataset="synthetic", run=f"{error_pct}", architecture=architecture, software_stack=stack,
                          num_gpus=gpus, parameters=int(parameters), num_experts=experts,
                          predicted_ms=100.0 + error_pct, measured_ms=100.0)


def test_regime_buckets_gpus_and_parameters():
    def regime(**kw):
        return regime_of(**{"architecture": "hopper", "software_stack": "x", "moe": False, **kw})
    assert regime(software_stack="megatron_core_te", num_gpus=8, parameters=1e9).words() == \
        "hopper, megatron_core_te, 1-8 GPUs, 100M-1B parameters, dense"
    assert regime(num_gpus=1, parameters=99e6).size == "under 100M parameters"
    moe = regime(architecture="ampere", software_stack="local_spec", num_gpus=3072, parameters=1e12, moe=True)
    assert moe.words() == "ampere, local_spec, 513-4,096 GPUs, over 100B parameters, MoE"
    assert regime(architecture="ampere", num_gpus=9, parameters=1.5e9).gpus == "9-64 GPUs"
    assert _run(1.0).regime.kind == "dense" and _run(1.0, experts=8).regime.kind == "MoE"


def test_band_is_the_empirical_p10_p90_of_its_regime():
    errors = [-20.0, -12.0, -9.0, -5.0, -3.0, 0.0, 1.0, 2.0, 6.0, 8.0, 11.0, 30.0]
    runs = [_run(e) for e in errors]
    band = band_from(runs, runs[0].regime)
    # inverted CDF over 12 runs: the 2nd smallest (1.2 -> 2) and the 11th (10.8 -> 11)
    assert (band.low_error_pct, band.high_error_pct) == (-12.0, 11.0)
    assert (band.low_error_pct, band.high_error_pct) == tuple(np.percentile(errors, [10, 90], method="inverted_cdf"))
    assert band.runs == band.runs_in_regime == 12 and not band.far and band.based_on == band.regime
    assert band.measured(100.0) == (100.0 / 1.11, 100.0 / 0.88)  # too fast a prediction: the band lies above it
    assert band.words() == ("p10-p90 error -12.0% to +11.0% of 12 calibration runs of its regime "
                            "(ampere, megatron_core_te, 1-8 GPUs, 100M-1B parameters, dense)")


def test_few_runs_give_their_extremes_and_a_regime_without_enough_borrows_a_wider_one():
    small = [_run(e) for e in (-4.0, 1.0, 3.0, 5.0, 9.0)]
    assert (band_from(small, small[0].regime).low_error_pct, band_from(small, small[0].regime).high_error_pct) == \
        (-4.0, 9.0)
    lone = _run(-50.0, gpus=64)
    band = band_from([*small, lone], lone.regime)
    assert band.runs_in_regime == 1 and band.runs == 6 and not band.far
    assert band.based_on == "ampere, megatron_core_te, 100M-1B parameters, dense"  # same size, any GPU count
    assert band.words().endswith("; 1 in its regime (ampere, megatron_core_te, 9-64 GPUs, 100M-1B parameters, dense)")
    other_size = _run(7.0, parameters=5e9)  # a size of its own: any architecture and stack of that size first
    assert band_from([*small, other_size], other_size.regime).based_on == "dense"  # then dense runs of any size
    moe = [_run(e, parameters=5e9, experts=8) for e in (-30.0, -25.0)]  # a dense plan borrows them last
    assert band_from([*small[:3], other_size, *moe], other_size.regime).based_on == "every run"


def test_a_plan_no_run_measured_is_far_from_calibration():
    runs = [_run(e) for e in (-4.0, 1.0, 3.0, 5.0, 9.0)]
    regime = regime_of(architecture="blackwell", software_stack="megatron_core_te", num_gpus=16384, parameters=4e11,
                       moe=False)
    band = band_from(runs, regime)
    assert band.far and band.runs_in_regime == 0 and band.based_on == "dense"
    assert band.words().endswith("; far from any calibration run: none in its regime "
                                 "(blackwell, megatron_core_te, over 4,096 GPUs, over 100B parameters, dense)")
    assert band_from([], regime) is None


DENSE_RUNS = [_run(e, gpus=g) for e, g in ((-2.0, 8), (1.0, 8), (2.0, 8), (3.0, 8), (4.0, 8), (6.0, 64))]


def test_an_moe_plan_with_moe_runs_of_its_size_gets_their_band():
    moe = [_run(e, experts=8) for e in (-35.0, -25.0, -21.0, -18.0, -12.0, -5.0)]
    band = band_from([*DENSE_RUNS, *moe], moe[0].regime)
    assert band.moe and band.regime == "ampere, megatron_core_te, 1-8 GPUs, 100M-1B parameters, MoE"
    assert (band.runs, band.runs_in_regime, band.low_error_pct, band.high_error_pct) == (6, 6, -35.0, -5.0)
    assert band.based_on == band.regime and not band.far and not band.note
    # on 64 GPUs: the MoE runs of its size on any GPU count, not the dense run of its own GPU bucket
    wide = band_from([*DENSE_RUNS, *moe], _run(0.0, gpus=64, experts=8).regime)
    assert wide.based_on == "ampere, megatron_core_te, 100M-1B parameters, MoE" and wide.far
    assert (wide.low_error_pct, wide.high_error_pct) == (-35.0, -5.0)
    # fewer than MIN_RUNS MoE runs of its size: they join the dense runs of its size, said to be few
    few = band_from([*DENSE_RUNS, *moe[:2]], _run(0.0, gpus=64, experts=8).regime)
    assert few.based_on == "ampere, megatron_core_te, 100M-1B parameters, dense + 100M-1B parameters, MoE"
    assert few.runs == 8 and (few.low_error_pct, few.high_error_pct) == (-35.0, 6.0)  # under ten: the extremes
    assert few.far and few.note == "only 2 MoE runs of this size calibrated; band of them and of dense runs"
    assert f"; {few.note}; far from any calibration run" in few.words()
    # a dense plan beside them keeps the dense runs' band
    dense = band_from([*DENSE_RUNS, *moe], DENSE_RUNS[0].regime)
    assert (dense.runs, dense.low_error_pct, dense.high_error_pct, dense.moe) == (5, -2.0, 4.0, False)


def test_an_moe_plan_without_moe_runs_of_its_size_gets_the_dense_band_and_is_far():
    other_size = [_run(e, parameters=5e10, experts=8) for e in (-40.0, -39.0, -38.0, -37.0, -36.0)]
    plan = _run(0.0, experts=64).regime
    band = band_from([*DENSE_RUNS, *other_size], plan)
    dense = band_from(DENSE_RUNS, DENSE_RUNS[0].regime)
    assert (band.low_error_pct, band.high_error_pct, band.runs) == (dense.low_error_pct, dense.high_error_pct, 5)
    assert band.based_on == "ampere, megatron_core_te, 1-8 GPUs, 100M-1B parameters, dense"
    assert band.far and band.runs_in_regime == 0 and band.note == NO_MOE_RUN
    assert band.words() == (
        "p10-p90 error -2.0% to +4.0% of 5 calibration runs of the wider regime (ampere, megatron_core_te, "
        "1-8 GPUs, 100M-1B parameters, dense); no MoE run of this size calibrated; band of dense runs; far from "
        "any calibration run: none in its regime (ampere, megatron_core_te, 1-8 GPUs, 100M-1B parameters, MoE)")
    as_json = band.to_dict(100.0, None)
    assert as_json["moe"] is True and as_json["far_from_calibration"] is True and as_json["note"] == NO_MOE_RUN
    # no run of its size at all: the MoE runs of any size before every run
    huge = band_from([*DENSE_RUNS, *other_size], _run(0.0, parameters=5e11, experts=64).regime)
    assert huge.based_on == "MoE" and huge.runs == 5 and not huge.note and huge.far


def test_shipped_file_schema_and_provenance():
    """Every run of the shipped file is the analytical estimate of a row of a data file whose bytes
    are the ones recorded, with the calibration files that ship now: a calibration that moved
    without ``make error-bands`` fails here."""
    bands = read_error_bands()
    data = json.loads(ERROR_BANDS_FILE.read_text())
    assert data["format_version"] == FORMAT_VERSION and data["percentiles"] == [10.0, 90.0]
    provenance = bands.provenance
    assert provenance["command"] == "python -m benchmarks.accuracy.error_bands"
    assert provenance["estimated_as"].startswith("vtrain estimate --no-db")
    assert {Path(p).name for p in provenance["data"]} == {
        "a100_single_node_calibration.csv", "a100_multi_node_calibration.csv", "a100_published_megatron_sc21.csv",
        "h100_published_calibration.csv", "b200_published_calibration.csv", "megatron_ci_calibration.csv"}
    for path, digest in {**provenance["data"], **provenance["calibrations"]}.items():
        assert hashlib.sha256((REPO / path).read_bytes()).hexdigest() == digest, f"{path} changed: make error-bands"
    assert all((REPO / p).resolve().is_relative_to(package_calibration_dir().resolve())
               for p in provenance["calibrations"])
    sets = {r.dataset for r in bands.runs}
    assert sets == set(provenance["sets"])
    for name, figures in provenance["sets"].items():
        runs = [r for r in bands.runs if r.dataset == name]
        assert figures["runs"] == len(runs)
        assert figures["mape_pct"] == pytest.approx(np.mean([abs(r.error_pct) for r in runs]))
    assert all(r.predicted_ms > 0 and r.measured_ms > 0 and r.num_gpus >= 1 and r.parameters > 0 for r in bands.runs)
    # dense or MoE recorded per run: the functional tests of MoE models are the file's MoE runs
    assert all("num_experts" in row for row in data["runs"])
    assert {r.dataset for r in bands.runs if r.num_experts is not None} == {"megatron_ci"}
    assert all(r.num_experts >= 2 for r in bands.runs if r.num_experts is not None)


def test_a_broken_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "bands.json"
    path.write_text(json.dumps({"format_version": FORMAT_VERSION, "runs": [{"dataset": "x"}]}))
    with pytest.raises(ConfigError, match=rf"^error-band file {path}: runs must be objects with dataset, run, "):
        read_error_bands(path)
    path.write_text("{}")
    with pytest.raises(ConfigError, match=r"format_version must be 2$"):
        read_error_bands(path)
    path.write_text(json.dumps({"format_version": 1, "runs": []}))  # a file without dense or MoE per run
    with pytest.raises(ConfigError, match=rf"^error-band file {path}: format_version must be 2$"):
        read_error_bands(path)
