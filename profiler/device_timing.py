"""Timing calls on a device: CUDA events on GPU, ``time.perf_counter_ns`` on CPU.

:func:`elapsed_ns` times a run of back-to-back calls. :func:`sample_ns` times one call
repeatedly under a :class:`TimingPolicy`: ``warmup`` calls, then ``n`` timed repetitions where
``n`` fills about ``budget_s`` (at least ``min_repetitions``, at most ``max_repetitions``). On GPU
the repetitions are queued without synchronizing between them (optionally writing a buffer of
twice the L2 size between repetitions to flush it). On CPU a buffer is written before each
repetition (``flush_cpu_cache``): in a training step an op finds its operands outside the caches,
evicted by the ops between, while back-to-back repetitions would keep them there (a 512 KiB
elementwise op runs about three times faster from L2; a 16 MiB one markedly faster from a
server's last-level cache). Operands up to 4 MiB are flushed from the private caches (16 MiB
written), larger ones from the last-level cache too (512 MiB written). The number of CPU threads
is left as the process has it: a CPU profile is compared with real training run under the same
conditions, and the fingerprint records ``torch.get_num_threads()``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vtrain_plugin.core.errors import ProfileError

# Written between CPU repetitions. Operands that fit the cores' private caches are evicted from
# there by a write larger than them; larger operands would stay in the (shared, server-sized) last
# level cache between back-to-back repetitions, while in a training step the ops in between evict
# them: those are flushed with a write larger than that cache.
_CPU_PRIVATE_FLUSH_NBYTES = 16 << 20
_CPU_SHARED_FLUSH_NBYTES = 512 << 20
_CPU_PRIVATE_CACHE_NBYTES = 4 << 20  # operands above this come from memory in a training step


@dataclass(frozen=True, slots=True, kw_only=True)
class TimingPolicy:
    warmup: int = 3
    min_repetitions: int = 5
    max_repetitions: int = 50
    budget_s: float = 0.2
    flush_l2: bool = False  # CUDA only
    flush_cpu_cache: bool = True  # CPU only: evict the cores' private caches before each timed call

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise ProfileError(f"timing warmup ({self.warmup}) must be >= 1")
        if not 1 <= self.min_repetitions <= self.max_repetitions:
            raise ProfileError(f"timing repetitions need 1 <= min_repetitions ({self.min_repetitions}) "
                               f"<= max_repetitions ({self.max_repetitions})")


def elapsed_ns(call: Callable[[], object], repetitions: int, device: torch.device) -> float:
    """Nanoseconds that ``repetitions`` back-to-back ``call()`` take on ``device``.

    On CUDA the device is synchronized first and the time is that of a CUDA event pair around
    the calls; elsewhere it is the ``time.perf_counter_ns`` wall time of the calls.
    """
    calls = itertools.repeat(None, repetitions)  # made before the clock starts: the timed loop only calls
    if device.type == "cuda":
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in calls:
                call()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) * 1e6
    t0 = time.perf_counter_ns()
    for _ in calls:
        call()
    return float(time.perf_counter_ns() - t0)


def sample_ns(call: Callable[[], object], device: torch.device, policy: TimingPolicy,
              operand_nbytes: int = 0) -> list[float]:
    """Durations in ns of the timed repetitions of ``call`` on ``device`` under ``policy``.

    ``operand_nbytes`` (the bytes ``call`` reads and writes) sizes the CPU cache flush.
    """
    if device.type == "cuda":
        return _time_cuda(call, device, policy)
    return _time_cpu(call, device, policy, operand_nbytes)


def _repetitions(per_call_s: float, policy: TimingPolicy) -> int:
    wanted = int(policy.budget_s / per_call_s) if per_call_s > 0 else policy.max_repetitions
    return max(policy.min_repetitions, min(policy.max_repetitions, wanted))


def _time_cpu(call: Callable[[], object], dev: torch.device, policy: TimingPolicy,
              operand_nbytes: int) -> list[float]:
    flush_nbytes = (_CPU_SHARED_FLUSH_NBYTES if operand_nbytes > _CPU_PRIVATE_CACHE_NBYTES
                    else _CPU_PRIVATE_FLUSH_NBYTES)
    flush = torch.empty(flush_nbytes // 4) if policy.flush_cpu_cache else None
    warm_ns = [elapsed_ns(call, 1, dev) for _ in range(policy.warmup)]
    samples = []
    for _ in range(_repetitions(min(warm_ns) / 1e9, policy)):
        if flush is not None:
            flush.fill_(1.0)
        samples.append(elapsed_ns(call, 1, dev))
    return samples


def _time_cuda(call: Callable[[], object], dev: torch.device, policy: TimingPolicy) -> list[float]:
    flush = None
    if policy.flush_l2:
        l2_bytes = torch.cuda.get_device_properties(dev).L2_cache_size
        flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=dev)
    with torch.cuda.device(dev):
        warm_ns = [elapsed_ns(call, 1, dev) for _ in range(policy.warmup)]
        n = _repetitions(min(warm_ns) / 1e9, policy)
        # One event pair per repetition, all queued before a single synchronize: elapsed_ns per
        # repetition would synchronize before each, so its time would include launching ``call``.
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            if flush is not None:
                flush.zero_()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize(dev)
    return [start.elapsed_time(end) * 1e6 for start, end in events]
