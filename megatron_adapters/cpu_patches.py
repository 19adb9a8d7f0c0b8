"""CPU stand-ins for the CUDA calls megatron-core makes while building and running a model.

All of them live here, applied by one context manager that restores the originals on exit:
nothing is patched at import time. Under FakeTensorMode no real memory is touched, so "the
current CUDA device" can safely be the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _cpu_current_device() -> str:
    return "cpu"


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _no_stream(*args: Any, **kwargs: Any) -> None:
    """megatron-core's MoE all-to-all dispatcher creates a side stream for device-to-host copies of
    its token counts; the traced dispatcher (megatron_adapters.moe) copies nothing."""
    return None


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


_MISSING = object()


@contextlib.contextmanager
def cpu_tracing_patches() -> Iterator[None]:
    """Patch, for the duration of the block, the CUDA entry points megatron-core 0.16 calls."""
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_adapters.stand_ins import stand_in_patches

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "synchronize", _no_op),
        (torch.Tensor, "cuda", _tensor_cuda),
        (torch.cuda, "Stream", _no_stream),
        # Activation checkpointing saves and restores the CUDA RNG; tracing needs no RNG state.
        (mrandom, "_get_cuda_rng_state", _cpu_rng_state),
        (mrandom, "_set_cuda_rng_state", _no_op),
        # Layers megatron-core cannot build on a CPU (attention masks on "cuda", TE's norm): stand_ins.py
        *stand_in_patches(),
    ]
    with patched(patches):
        yield


@contextlib.contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each ``(object, attribute, value)`` for the duration of the block, then restore it."""
    saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
