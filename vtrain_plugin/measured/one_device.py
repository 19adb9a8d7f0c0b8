"""One-device validation: train a plan for real on this machine's device and compare with its estimate.

:func:`validate` builds the real megatron-core model of a plan on this machine's device (one device:
tensor, pipeline and data parallelism set to 1, the result says which fields it overrode), trains it
for a few iterations on random tokens with the real optimizer, and compares the median iteration
time after warm-up with the estimate of the same one-device plan from the profile database of that
device; the package exports it: ``vtrain_plugin.validate(run)``.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from profiler.fingerprint import current_fingerprint
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError, ProfileError
from vtrain_plugin.core.units import GIB
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.devices import get_device, gpu_name_matches, known_devices
from vtrain_plugin.measured.iterations import IterationComparison, compare_iterations
from vtrain_plugin.runs import with_gpu
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import SoftwareStack

_SINGLE_DEVICE = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "virtual_pipeline": 1,
                  "sequence_parallel": False, "context_parallel": 1}

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
        comparison=compare_iterations(predicted, measured.iteration_ms),
        peak_memory_measured_gib=measured.peak_memory_bytes / GIB,
        peak_memory_predicted_gib=peak.total_gib - peak.allowance_gib, memory_measure=_memory_measure(device),
        measured_fraction=predicted.measured_fraction, breakdown_ms=predicted.breakdown_ms, warnings=warnings)


def _memory_measure(device: str) -> str:
    """What :func:`megatron_adapters.real_model.train` measures as peak memory on ``device``."""
    if device.startswith("cuda"):
        return "torch.cuda.max_memory_allocated (tensors; the predicted allowance left out)"
    return "growth of the peak resident set (VmHWM) over model build and training (predicted allowance left out)"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationResult:
    config: str
    device: str  # the device trained on, in words
    overridden: tuple[str, ...]  # plan fields set to their one-device value, "field: old -> new"
    num_microbatches: int
    warmup_iterations: int
    comparison: IterationComparison
    peak_memory_measured_gib: float
    peak_memory_predicted_gib: float  # the estimate's tensors (weights, gradients, optimizer, activations)
    memory_measure: str  # what the measured peak is, in words (it differs between CPU and CUDA)
    measured_fraction: float  # share of the predicted kernel time that came from the profile database
    breakdown_ms: dict[str, float]
    warnings: tuple[str, ...] = ()  # why the measured times may be noisy (noise_warnings)

    @property
    def memory_error_pct(self) -> float | None:
        """Signed error of the predicted peak against the measured one; None when nothing was measured."""
        if not self.peak_memory_measured_gib > 0:
            return None
        return 100.0 * (self.peak_memory_predicted_gib - self.peak_memory_measured_gib) / self.peak_memory_measured_gib

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "device": self.device, "overridden": list(self.overridden),
                "num_microbatches": self.num_microbatches, "warmup_iterations": self.warmup_iterations,
                **self.comparison.to_dict(), "peak_memory_measured_gib": self.peak_memory_measured_gib,
                "peak_memory_predicted_gib": self.peak_memory_predicted_gib,
                "memory_error_pct": self.memory_error_pct, "memory_measure": self.memory_measure,
                "measured_fraction": self.measured_fraction, "predicted_breakdown_ms": self.breakdown_ms,
                "warnings": list(self.warnings)}


# A timing is noisy when other work competes for the cores: above half a runnable process per core
# on average over the last minute, or when the timed iterations spread by more than a fifth of their
# median (identical iterations of one model on an idle machine stay within a few per cent).
LOADED_RUNNABLE_PER_CPU = 0.5
NOISY_SPREAD = 0.2


def noise_warnings(load_1min: float, cpu_count: int, samples_ms: Sequence[float]) -> tuple[str, ...]:
    """One line per reason the measured iteration times may be noisy (see the constants above)."""
    out = []
    if load_1min > LOADED_RUNNABLE_PER_CPU * cpu_count:
        out.append(f"the machine is loaded (load average {load_1min:.2f} over 1 min on {cpu_count} CPUs, above "
                   f"{LOADED_RUNNABLE_PER_CPU:g} per CPU): measured times are noisy")
    median = statistics.median(samples_ms)
    spread = (max(samples_ms) - min(samples_ms)) / median
    if spread > NOISY_SPREAD:
        out.append(f"the measured iterations spread by {100 * spread:.0f}% of their median "
                   f"({min(samples_ms):,.1f} to {max(samples_ms):,.1f} ms, above {100 * NOISY_SPREAD:.0f}%): "
                   f"measured times are noisy")
    return tuple(out)


def single_device_run(run: RunConfig, device: str = "cpu") -> tuple[RunConfig, tuple[str, ...]]:
    """``run`` on one local device (TP = PP = DP = 1, on the preset of ``device``) and the fields changed."""
    current = run.parallel.to_dict()
    overridden = tuple(f"{name}: {current[name]} -> {value}" for name, value in _SINGLE_DEVICE.items()
                       if current[name] != value)
    plan = ParallelPlan(**{**current, **_SINGLE_DEVICE})
    training = run.training
    if training.tp_comm_overlap:  # no tensor parallelism left to overlap
        overridden += ("tp_comm_overlap: True -> False",)
        training = replace(training, tp_comm_overlap=False)
    try:
        single = with_gpu(replace(run, parallel=plan, training=training), local_device_preset(device))
    except ConfigError as exc:
        raise ConfigError(f"{run.source}: on one device: {exc}") from None
    # The real step trains megatron-core's local spec: its estimate assumes the same kernels.
    stack = single.training.stack_for(single.model, get_device(single.cluster.gpu).architecture)
    if stack is not SoftwareStack.LOCAL_SPEC or single.training.fp8 is not None:
        fp8 = "" if single.training.fp8 is None else f", fp8 {single.training.fp8.value}"
        overridden += (f"software_stack: {stack.value}{fp8} -> local_spec (what the real step runs)",)
        single = replace(single, training=replace(single.training, software_stack=SoftwareStack.LOCAL_SPEC, fp8=None))
    # The real step accumulates a bf16 model's gradients in bf16 (each weight's ``.grad``, cast to fp32 in
    # the optimizer step): the memory of Megatron's bf16 gradient buffer, not of its fp32 default.
    if single.model.dtype is Dtype.BF16 and not single.training.grad_reduce_in_bf16:
        overridden += ("grad_reduce_in_bf16: False -> True (what the real step runs)",)
        single = replace(single, training=replace(single.training, grad_reduce_in_bf16=True))
    return single, overridden


def local_device_preset(device: str) -> str:
    """The device preset this machine's ``device`` ("cpu", "cuda", "cuda:N") is an instance of."""
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ConfigError(f"device {device!r} must be 'cpu', 'cuda' or 'cuda:N'")
    import torch  # here, not at module level: estimates never need torch, and it takes seconds to load

    if not torch.cuda.is_available():
        raise ProfileError(f"device {device!r} requested but torch.cuda.is_available() is False")
    name = torch.cuda.get_device_name(torch.device(device))
    matches = [p for p in known_devices() if p != "cpu" and gpu_name_matches(p, name)]
    if not matches:
        raise ProfileError(f"no device preset describes the local GPU {name!r}; known presets: "
                           f"{', '.join(known_devices())}")
    return matches[0]
