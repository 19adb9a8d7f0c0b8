"""What needs a real device: :func:`validate`, training a plan for real and comparing it with its estimate.

:func:`validate` builds the real megatron-core model of a plan on this machine's device (one device:
tensor, pipeline and data parallelism set to 1, the result says which fields it overrode), trains it
for a few iterations on random tokens with the real optimizer, and compares the median iteration
time after warm-up with the estimate of the same one-device plan from the profile database of that
device; the package exports it: ``vtrain_plugin.validate(run)``.
"""

from __future__ import annotations

import logging
import os

from profiler.fingerprint import current_fingerprint
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import GIB
from vtrain_plugin.estimate import estimate
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.validation import ValidationResult, compare, noise_warnings, single_device_run

logger = logging.getLogger(__name__)


def validate(run: RunConfig, *, device: str = "cpu", db_path: str | os.PathLike | None = None,
             iterations: int = 5, warmup: int = 1) -> ValidationResult:
    """Train ``run`` for real on one local device and compare with its estimate (see the module doc)."""
    from megatron_adapters.real_model import train  # torch and megatron-core: loaded only to train

    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"iterations must be a positive integer, got {iterations!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup must be a non-negative integer, got {warmup!r}")
    single, overridden = single_device_run(run, device)
    predicted = estimate(single, profile_db=db_path)
    load = os.getloadavg()[0]  # before training: what else competes for the cores while it is timed
    measured = train(single.model, single.parallel, num_microbatches=single.num_microbatches,
                     iterations=iterations, warmup=warmup, device=device)
    warnings = noise_warnings(load, os.cpu_count() or 1, measured.iteration_ms)
    for line in warnings:
        logger.warning("warning: %s", line)
    peak = max(predicted.memory_gib, key=lambda m: m.total_gib)
    return ValidationResult(
        config=run.source, device=current_fingerprint(device).label, overridden=overridden,
        num_microbatches=single.num_microbatches, warmup_iterations=warmup,
        comparison=compare(predicted, measured.iteration_ms),
        peak_memory_measured_gib=measured.peak_memory_bytes / GIB,
        peak_memory_predicted_gib=peak.total_gib - peak.allowance_gib, memory_measure=_memory_measure(device),
        measured_fraction=predicted.measured_fraction, breakdown_ms=predicted.breakdown_ms, warnings=warnings)


def _memory_measure(device: str) -> str:
    """What :func:`megatron_adapters.real_model.train` measures as peak memory on ``device``."""
    if device.startswith("cuda"):
        return "torch.cuda.max_memory_allocated (tensors; the predicted allowance left out)"
    return "growth of the peak resident set (VmHWM) over model build and training (predicted allowance left out)"
