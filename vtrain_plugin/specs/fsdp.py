"""Fully sharded data parallelism of a run (``TrainingSpec.fsdp``): which implementation, what it
shards over the data-parallel group, and how it buffers and prefetches the gathered layers.

Megatron-FSDP (Megatron-LM's ``--use-megatron-fsdp``) and torch FSDP2 (``--use-torch-fsdp2``) both
gather each transformer layer's parameters before its forward and backward and reduce-scatter its
gradients after its backward; what they shard and keep changes memory and communication alike, so
the settings are validated here and priced in :mod:`vtrain_plugin.cost.comm.fsdp`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError


GRAD_COMM_DTYPES = ("fp32", "bf16", "fp16")  # Megatron-LM's choices besides auto


class FsdpImplementation(StrEnum):
    MEGATRON = "megatron"  # Megatron-FSDP (megatron/core/distributed/fsdp)
    TORCH = "torch"  # torch FSDP2 (fully_shard), megatron-core's TorchFullyShardedDataParallel


class ShardingStrategy(StrEnum):
    """What Megatron-FSDP shards over the data-parallel group (``--data-parallel-sharding-strategy``)."""

    NO_SHARD = "no_shard"  # nothing: DDP with its all-reduce
    OPTIM = "optim"  # fp32 main weights and Adam state (ZeRO-1)
    OPTIM_GRADS = "optim_grads"  # and the gradients, reduce-scattered after every backward (ZeRO-2)
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # and the model weights, gathered layer by layer (ZeRO-3)

    @property
    def shards_optimizer(self) -> bool:
        return self is not ShardingStrategy.NO_SHARD

    @property
    def shards_gradients(self) -> bool:
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_parameters(self) -> bool:
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS


@dataclass(frozen=True, slots=True, kw_only=True)
class FsdpSettings:
    implementation: FsdpImplementation = FsdpImplementation.MEGATRON
    # Megatron-FSDP's strategy (its default); torch FSDP2 always shards all three (optim_grads_params).
    sharding_strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    # Megatron-FSDP's --fsdp-double-buffer: two fixed buffers for the gathered layers and two for their
    # unsharded gradients, so at most one layer is prefetched.
    double_buffer: bool = False
    # torch FSDP2's reshard_after_forward (--torch-fsdp2-no-reshard-after-forward turns it off): the
    # gathered weights are freed after forward and gathered again for backward.
    reshard_after_forward: bool = True
    # Megatron-FSDP's --suggested-communication-unit-size (elements): the reduce-scatter queue holds
    # this many gradient elements, the all-gather prefetches half of it; None: Megatron-FSDP's
    # default, max(1e9, twice the mean layer) elements.
    communication_unit_elements: int | None = None
    # Megatron-FSDP's --megatron-fsdp-grad-comm-dtype: the dtype its gradient reduce-scatters move
    # (bytes on the wire); None: "auto", the run's gradient dtype (the main-grad buffer's).
    grad_comm_dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "implementation", FsdpImplementation(v.one_of(
            "training.fsdp.implementation", self.implementation, [i.value for i in FsdpImplementation])))
        object.__setattr__(self, "sharding_strategy", ShardingStrategy(v.one_of(
            "training.fsdp.sharding_strategy", self.sharding_strategy, [s.value for s in ShardingStrategy])))
        v.boolean("training.fsdp.double_buffer", self.double_buffer)
        v.boolean("training.fsdp.reshard_after_forward", self.reshard_after_forward)
        if self.communication_unit_elements is not None:
            v.positive_int("training.fsdp.communication_unit_elements", self.communication_unit_elements)
        if self.grad_comm_dtype is not None:
            v.one_of("training.fsdp.grad_comm_dtype", self.grad_comm_dtype, list(GRAD_COMM_DTYPES))
        torch = self.implementation is FsdpImplementation.TORCH
        if torch and self.grad_comm_dtype is not None:
            raise ConfigError("training.fsdp.grad_comm_dtype is Megatron-FSDP's: it needs implementation megatron")
        if torch and self.sharding_strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            raise ConfigError(f"training.fsdp.sharding_strategy {self.sharding_strategy.value} with implementation "
                              f"torch: torch FSDP2 shards weights, gradients and optimizer state "
                              f"(optim_grads_params)")
        if torch and (self.double_buffer or self.communication_unit_elements is not None):
            raise ConfigError("training.fsdp.double_buffer and communication_unit_elements are Megatron-FSDP's: "
                              "they need implementation megatron")
        if not torch and not self.reshard_after_forward:
            raise ConfigError("training.fsdp.reshard_after_forward false is torch FSDP2's: it needs implementation "
                              "torch (Megatron-FSDP reshards after forward)")

    @classmethod
    def of(cls, value: Any) -> FsdpSettings | None:
        """The settings given as themselves, a plan file's mapping, or None."""
        return v.settings_of(cls, "training.fsdp", value)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["implementation"] = self.implementation.value
        d["sharding_strategy"] = self.sharding_strategy.value
        return d

    @property
    def label(self) -> str:
        """One word for reports: ``megatron:optim_grads_params``, ``torch``."""
        if self.implementation is FsdpImplementation.TORCH:
            return "torch" + ("" if self.reshard_after_forward else ":no_reshard")
        return f"megatron:{self.sharding_strategy.value}" + (":double_buffer" if self.double_buffer else "")

    def assumptions(self) -> tuple[str, ...]:
        """What the estimate takes for granted about this FSDP (see vtrain_plugin.specs.assumptions)."""
        return (f"FSDP ({self.label}): every block (embedding, each layer, output layer) is one unit; its "
                f"all-gathers and reduce-scatters share one link, issued as megatron-core 0.16 issues them, "
                f"and bucket padding is left out",)

    @property
    def prefetches_one_layer(self) -> bool:
        """Whether at most one layer is gathered ahead: Megatron-FSDP's double buffer, or torch FSDP2
        (whose next layer's all-gather is issued while the current one computes)."""
        return self.double_buffer or self.implementation is FsdpImplementation.TORCH
