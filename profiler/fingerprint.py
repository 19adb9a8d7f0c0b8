"""The identity of the device a kernel was measured on.

Two measurements are interchangeable when they were taken on the same kind of device with the same
software: the accelerator (name and SM count) or, on CPU, the CPU model and the number of threads
torch uses, plus the torch and CUDA versions. The dtype of a kernel is part of its
:class:`~vtrain_plugin.graph.KernelKey`, not of the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from vtrain_plugin.core.errors import ProfileError


class DeviceKind(StrEnum):
    CUDA = "cuda"
    CPU = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFingerprint:
    kind: DeviceKind
    device_name: str  # GPU name ("NVIDIA H100 80GB HBM3") or, for CPU, the CPU model
    sm_count_or_cores: int  # streaming multiprocessors, or the CPU threads torch uses
    cpu_model: str
    torch_version: str
    cuda_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceFingerprint:
        try:
            return cls(
                kind=DeviceKind(d["kind"]),
                device_name=str(d["device_name"]),
                sm_count_or_cores=int(d["sm_count_or_cores"]),
                cpu_model=str(d["cpu_model"]),
                torch_version=str(d["torch_version"]),
                cuda_version=None if d.get("cuda_version") is None else str(d["cuda_version"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"device fingerprint {d!r} is invalid: {exc}") from None

    @property
    def id(self) -> str:
        """Stable 16-hex-digit id: SHA-1 of the canonical JSON of every field."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        if self.kind is DeviceKind.CUDA:
            return (f"{self.device_name} ({self.sm_count_or_cores} SMs, CUDA {self.cuda_version}, "
                    f"torch {self.torch_version})")
        return f"{self.device_name} ({self.sm_count_or_cores} threads, torch {self.torch_version})"


def current_fingerprint(device: str) -> DeviceFingerprint:
    """Fingerprint of ``device`` ("cpu", "cuda" or "cuda:N") as this process sees it.

    On CPU the core count is ``torch.get_num_threads()``: the threads the measured ops actually
    use, which is what their durations depend on. torch is imported here, not with the module: an
    estimate reads stored fingerprints from the profile database without loading torch.
    """
    import torch

    kind = _device_kind(device)
    cpu = cpu_model()
    if kind is DeviceKind.CPU:
        return DeviceFingerprint(kind=kind, device_name=cpu, sm_count_or_cores=torch.get_num_threads(),
                                 cpu_model=cpu, torch_version=torch.__version__)
    if not torch.cuda.is_available():
        raise ProfileError(f"device {device!r} requested but torch.cuda.is_available() is False")
    props = torch.cuda.get_device_properties(torch.device(device))
    return DeviceFingerprint(kind=kind, device_name=props.name, sm_count_or_cores=props.multi_processor_count,
                             cpu_model=cpu, torch_version=torch.__version__, cuda_version=torch.version.cuda)


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what :mod:`platform` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("model name", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _device_kind(device: str) -> DeviceKind:
    base = device.split(":", 1)[0]
    try:
        return DeviceKind(base)
    except ValueError:
        raise ProfileError(f"device {device!r} is not supported (use 'cpu', 'cuda' or 'cuda:N')") from None

