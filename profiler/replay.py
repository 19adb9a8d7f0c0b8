"""Replaying traced aten ops on a real device, timing them and storing the timings.

:func:`replay_kernel` rebuilds the call of one :class:`~vtrain_plugin.core.graph.KernelKey`
(:mod:`profiler.kernel_call`) and times it (:mod:`profiler.device_timing`): the median and the
interquartile range of the timed repetitions. :func:`profile_kernels` measures every key a
:class:`~profiler.db.ProfileDB` lacks for a device and stores the rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from profiler.db import ProfileDB
from profiler.device_timing import TimingPolicy, sample_ns
from profiler.fingerprint import DeviceFingerprint, current_fingerprint
from profiler.kernel_call import build_call, operand_nbytes
from profiler.progress import ProgressBar
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import KernelKey


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    median_ns: float
    repetitions: int
    iqr_ns: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileSummary:
    measured: int
    skipped: int  # already in the database
    failed: tuple[tuple[KernelKey, str], ...] = ()  # (key, reason)


def replay_kernel(key: KernelKey, device: str = "cpu", *, policy: TimingPolicy | None = None) -> ReplayResult:
    """Median duration of ``key`` run on ``device``; ProfileError names the op when it cannot be replayed."""
    policy = policy or TimingPolicy()
    dev = torch.device(device)
    try:
        op, kwargs = build_call(key, dev)

        def call() -> None:
            op(**kwargs)

        samples_ns = sample_ns(call, dev, policy, operand_nbytes(kwargs))
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ProfileError(f"kernel {key.op}: replay on {dev} failed: {first_line}") from None
    median_ns = statistics.median(samples_ns)
    if median_ns <= 0:
        raise ProfileError(f"kernel {key.op}: measured median {median_ns} ns on {dev} is not positive")
    q1, _, q3 = statistics.quantiles(samples_ns, n=4) if len(samples_ns) > 1 else (median_ns,) * 3
    return ReplayResult(median_ns=float(median_ns), repetitions=len(samples_ns), iqr_ns=float(q3 - q1))


def profile_kernels(keys: Iterable[KernelKey], device: str, db: ProfileDB,
                    fingerprint: DeviceFingerprint | None = None, *, force: bool = False, progress: bool = True,
                    policy: TimingPolicy | None = None) -> ProfileSummary:
    """Measure every key not yet in ``db`` for ``fingerprint`` (all of them with ``force``), storing each row.

    Keys that cannot be replayed are reported in ``failed`` with the reason, not raised.
    """
    fp = fingerprint or current_fingerprint(device)
    if fp.kind != torch.device(device).type:
        raise ProfileError(f"fingerprint {fp.label} is a {fp.kind} device but the kernels run on {device!r}")
    unique = list(dict.fromkeys(keys))
    existing = {} if force else db.get_kernels(fp, unique)
    todo = [k for k in unique if k not in existing]
    failed: list[tuple[KernelKey, str]] = []
    with ProgressBar(len(todo), f"profiling on {fp.device_name}", enabled=progress) as bar:
        for key in todo:
            try:
                result = replay_kernel(key, device, policy=policy)
            except ProfileError as exc:
                failed.append((key, str(exc)))
            else:
                db.put_kernel(fp, key, result.median_ns, result.repetitions, result.iqr_ns)
            bar.advance(note=key.op)
    return ProfileSummary(measured=len(todo) - len(failed), skipped=len(existing), failed=tuple(failed))
