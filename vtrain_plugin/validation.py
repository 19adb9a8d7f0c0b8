"""Predicted versus measured: the comparison behind ``vtrain validate`` and a small API for users'
own training loops.

:func:`vtrain_plugin.measure.validate` builds the real megatron-core model of a plan on this machine's device (one
device: tensor, pipeline and data parallelism are set to 1, and the result says which fields it
overrode), trains it for a few iterations on random tokens with the real optimizer, and compares
the median iteration time after warm-up with :func:`~vtrain_plugin.estimate.estimate` of the same
one-device plan from the profile database of that device.

For a user's own loop::

    recorder = IterationRecorder(warmup=2, synchronize=torch.cuda.synchronize)
    for batch in data:
        with recorder:
            train_step(batch)
    print(recorder.compare(est).error_pct)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vtrain_plugin.api import with_gpu
from vtrain_plugin.core.errors import ConfigError, ProfileError
from vtrain_plugin.estimate import Estimate
from vtrain_plugin.hardware.devices import get_device, gpu_name_matches, known_devices
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.run import RunConfig
from vtrain_plugin.specs.training import SoftwareStack


_SINGLE_DEVICE = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "virtual_pipeline": 1,
                  "sequence_parallel": False, "context_parallel": 1}


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    predicted_ms: float
    measured_ms: float  # median of the measured iterations
    measured_iterations_ms: tuple[float, ...]

    @property
    def error_pct(self) -> float:
        """Signed error of the prediction relative to the measurement: positive = predicted too slow."""
        return 100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms, "error_pct": self.error_pct,
                "measured_iterations_ms": list(self.measured_iterations_ms)}


def compare(predicted: Estimate | float, measured_ms: Sequence[float]) -> Comparison:
    """Compare an estimate (or a predicted time in ms) with measured iteration times in ms (median)."""
    samples = tuple(float(ms) for ms in measured_ms)
    if not samples:
        raise ConfigError("compare: measured_ms must hold at least one iteration time")
    if any(not ms > 0 for ms in samples):
        raise ConfigError(f"compare: measured iteration times must be positive, got {min(samples)}")
    predicted_ms = predicted.iteration_time_ms if isinstance(predicted, Estimate) else float(predicted)
    return Comparison(predicted_ms=predicted_ms, measured_ms=statistics.median(samples),
                      measured_iterations_ms=samples)


class IterationRecorder:
    """Times iterations of a training loop: ``with recorder: step()`` per iteration, or :meth:`record`.

    The first ``warmup`` iterations are recorded but left out of :attr:`samples_ms`.
    ``synchronize`` (e.g. ``torch.cuda.synchronize``) is called before the clock starts and
    before it stops, so asynchronous device work is counted in its iteration.
    """

    def __init__(self, *, warmup: int = 1, synchronize: Callable[[], None] | None = None) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"IterationRecorder warmup must be a non-negative integer, got {warmup!r}")
        self.warmup = warmup
        self._synchronize = synchronize
        self._all_ms: list[float] = []
        self._start_ns: int | None = None

    def __enter__(self) -> IterationRecorder:
        if self._synchronize is not None:
            self._synchronize()
        self._start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._synchronize is not None and exc_type is None:
            self._synchronize()
        start, self._start_ns = self._start_ns, None
        if exc_type is None and start is not None:
            self.record((time.perf_counter_ns() - start) / 1e6)

    def record(self, ms: float) -> None:
        """Add one iteration that took ``ms`` milliseconds (timed by the caller)."""
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0:
            raise ConfigError(f"iteration time must be a positive number of ms, got {ms!r}")
        self._all_ms.append(float(ms))

    @property
    def samples_ms(self) -> tuple[float, ...]:
        return tuple(self._all_ms[self.warmup:])

    def compare(self, predicted: Estimate | float) -> Comparison:
        if not self.samples_ms:
            raise ConfigError(f"IterationRecorder has {len(self._all_ms)} iterations, none after the "
                              f"{self.warmup} warm-up ones")
        return compare(predicted, self.samples_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationResult:
    config: str
    device: str  # the device trained on, in words
    overridden: tuple[str, ...]  # plan fields set to their one-device value, "field: old -> new"
    num_microbatches: int
    warmup_iterations: int
    comparison: Comparison
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
