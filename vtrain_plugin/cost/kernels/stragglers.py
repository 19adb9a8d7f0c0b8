"""The slowest GPU of a synchronous job: why large runs are slower than one GPU's kernels suggest.

Nominally identical GPUs do not run at the same speed: clocks under power and thermal limits, and
silicon, differ from card to card. Sinha et al. ("Not All GPUs Are Created Equal: Characterizing
Variability in Large-Scale, Accelerator-Rich Systems", SC'22) timed the same compute-bound kernels
on thousands of GPUs of several production clusters and found a spread of several percent up to
about 20% between the fastest and the slowest (SGEMM). A training step synchronises every GPU of
the job: tensor-parallel collectives in every layer, pipeline transfers every micro-batch, the
data-parallel gradient reduction every iteration. So the job advances at the pace of its slowest
GPU, and the more GPUs it has, the slower that one is expected to be.

Assumption (documented, not fitted per run): each GPU's sustained speed is ``1 - spread * z`` with
``z`` standard normal and independent between GPUs, constant over the run (static variation;
jitter that changes from kernel to kernel averages out over the thousands of kernels between two
synchronisations). The expected slowest of ``N`` GPUs then stretches device time by
``1 + spread * E[max of N standard normals]`` (0 for one GPU, 0.56 for 2, 1.42 for 8, 2.34 for 64,
3.55 for 3,072, growing like sqrt(2 ln N)). ``spread`` is the calibrated constant
``gpu_speed_spread`` (:mod:`vtrain_plugin.hardware.calibration`): a range of about 6.5 standard
deviations among a thousand GPUs, so SC'22's 2-20% ranges are a spread of 0.3-3%.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

_GRID = np.linspace(-9.0, 9.0, 18001)
_PDF = np.exp(-0.5 * _GRID**2) / math.sqrt(2.0 * math.pi)
_CDF = 0.5 * (1.0 + np.array([math.erf(x / math.sqrt(2.0)) for x in _GRID]))


@lru_cache(maxsize=4096)
def expected_max_standard_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals]: 0 for 1, 1/sqrt(pi) for 2, 3/(2 sqrt(pi)) for 3."""
    if n < 1:
        raise ValueError(f"expected_max_standard_normal needs n >= 1, got {n}")
    if n == 1:
        return 0.0
    f = _GRID * n * _PDF * _CDF ** (n - 1)
    return float((f.sum() - 0.5 * (f[0] + f[-1])) * (_GRID[1] - _GRID[0]))  # trapezoidal rule


def slowest_gpu_factor(spread: float, gpus: int) -> float:
    """How much longer the slowest of ``gpus`` GPUs takes than a typical one (``spread``: relative
    standard deviation of GPU speed)."""
    return 1.0 + spread * expected_max_standard_normal(gpus)
