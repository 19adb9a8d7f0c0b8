"""Fine-grained activation offloading of a run (``TrainingSpec.activation_offload``): which modules'
saved activations go to host memory, what share of their groups, and the per-tensor size floor.

megatron-core 0.16's ``fine_grained_activation_offload`` copies the tensors a named module saves
for backward to pinned host memory after its forward and back before its backward, on side streams:
it trades HBM for host-link traffic, so the settings are validated here and priced in
:mod:`vtrain_plugin.cost.activation_offload` (memory and exposed copy time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError

# megatron-core 0.16's TransformerConfig.offload_modules choices (its __post_init__ lists them).
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
DEFAULT_MIN_TENSOR_ELEMENTS = 1024 * 1024  # TransformerConfig.min_offloaded_tensor_size


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationOffload:
    # The module groups whose saved tensors are offloaded (OFFLOAD_MODULES), in the order given.
    modules: tuple[str, ...]
    # Share of the eligible offload groups offloaded (Megatron-LM's --activation-offload-fraction).
    fraction: float = 1.0
    # Tensors with fewer elements stay on the GPU (--min-offloaded-tensor-size).
    min_tensor_elements: int = DEFAULT_MIN_TENSOR_ELEMENTS

    def __post_init__(self) -> None:
        if isinstance(self.modules, str) or not isinstance(self.modules, (list, tuple)) or not self.modules:
            raise ConfigError(f"training.activation_offload.modules must be a non-empty list of "
                              f"{', '.join(OFFLOAD_MODULES)}, got {self.modules!r}")
        object.__setattr__(self, "modules", tuple(
            v.one_of("training.activation_offload.modules", m, OFFLOAD_MODULES) for m in self.modules))
        if "attn_proj" in self.modules and "core_attn" not in self.modules:
            raise ConfigError("training.activation_offload.modules: attn_proj needs core_attn (its input is the "
                              "attention's output, which core_attn's backward reads; megatron-core refuses it alone)")
        fraction = v.positive_finite_number("training.activation_offload.fraction", self.fraction)
        if fraction > 1:
            raise ConfigError(f"training.activation_offload.fraction ({fraction:g}) must lie in (0, 1]")
        v.positive_int("training.activation_offload.min_tensor_elements", self.min_tensor_elements)

    @classmethod
    def of(cls, value: Any) -> ActivationOffload | None:
        """The settings given as themselves, a plan file's mapping, or None."""
        return v.settings_of(cls, "training.activation_offload", value, required=("modules",))

    def to_dict(self) -> dict[str, Any]:
        return {"modules": list(self.modules), "fraction": self.fraction,
                "min_tensor_elements": self.min_tensor_elements}

    @property
    def label(self) -> str:
        share = "" if self.fraction == 1 else f" x{self.fraction:g}"
        return ",".join(self.modules) + share
