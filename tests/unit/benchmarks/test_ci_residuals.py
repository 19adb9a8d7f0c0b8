"""benchmarks/accuracy/ci_residuals: the diagnostics of the functional-test residuals (each test
case's A100 / H100 ratio, the ceiling of a per-feature correction) compute what they say."""

import numpy as np

from benchmarks.accuracy import ci_data
from benchmarks.accuracy.ci_residuals import feature_ceiling, gpu_ratios


def test_the_environment_of_each_run_is_read_by_its_name():
    env = ci_data.read_env()
    assert len(env) == 99
    assert env["gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic (A100)"] == (
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 NCCL_ALGO=Ring CUDA_DEVICE_MAX_CONNECTIONS=1")


def test_gpu_ratios_pair_the_two_gpus_of_a_test_case():
    feats = [{"gpu": "A100", "stack": "te", "deterministic": True}, {"gpu": "H100", "stack": "te", "deterministic": True},
             {"gpu": "A100", "stack": "te", "deterministic": False}]
    rows, mape = gpu_ratios(feats, ["a", "a", "b"], np.array([150.0, 100.0, 80.0]), np.array([200.0, 100.0, 90.0]))
    assert rows == [["a", "te", "True", "2.00", "1.50", "-25.0"]]  # "b" ran on one GPU only
    assert mape == 25.0


def test_a_correction_the_host_shares_explain_reaches_zero_and_a_feature_factor_leaves_out_badly():
    shares = np.array([[0.5, 0.1], [0.2, 0.3], [0.4, 0.4], [0.1, 0.6]])
    predicted = np.array([100.0, 120.0, 90.0, 110.0])
    measured = predicted * np.exp(shares @ np.array([0.2, -0.1]))  # exactly a rescale of the two host constants
    feats = [{"gpu": g} for g in ("A100", "H100", "A100", "H100")]
    rows = feature_ceiling(feats, shares, predicted, measured, ["a", "b", "c", "d"])
    assert [r[:3] for r in rows] == [["host constants free", "2", "0.00"],
                                     *([f"host constants and every feature value free, ridge {lam}", "3", "0.00"]
                                       for lam in ("0.1", "1", "10"))]
    assert rows[0][3] == "0.00"  # each run left out is still a rescale of the others' constants
