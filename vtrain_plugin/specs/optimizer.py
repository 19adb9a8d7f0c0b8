"""Which optimizer a run steps with, and in which dtypes it keeps its state (``training.optimizer``).

Adam (Megatron-LM's default), SGD with momentum, or Muon (Newton-Schulz orthogonalised momentum on the
2-D weights of the layers, Adam on everything else, as megatron-core's ``get_megatron_muon_optimizer``
splits them); Adam's state optionally in narrower dtypes (TransformerEngine's precision-aware FusedAdam,
Megatron-LM's ``--use-precision-aware-optimizer``). Why a spec of its own: the optimizer sets the bytes
of state per parameter (memory) and the bytes and FLOPs of the step (time), nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError

STATE_NBYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}  # per element; fp8's per-tensor scale left out
MUON_DEFAULT_NS_STEPS = 5  # Megatron-LM's --muon-num-ns-steps default


class OptimizerKind(StrEnum):
    ADAM = "adam"
    SGD = "sgd"  # apex FusedSGD with momentum (Megatron-LM's --sgd-momentum, 0.9): one fp32 buffer
    MUON = "muon"  # 2-D layer weights: momentum + Newton-Schulz; the rest: Adam


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """The optimizer and its state dtypes. Dtypes other than fp32 need ``precision_aware`` (megatron-core's
    OptimizerConfig asserts it), which needs Adam; ``main_grads`` fp32 or bf16, ``main_params`` fp32 or
    fp16, the moments fp32, fp16, bf16 or fp8 (Megatron-LM's choices)."""

    kind: OptimizerKind = OptimizerKind.ADAM
    muon_ns_steps: int = MUON_DEFAULT_NS_STEPS
    precision_aware: bool = False
    main_grads: str = "fp32"
    main_params: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OptimizerKind(
            v.one_of("training.optimizer.kind", self.kind, [k.value for k in OptimizerKind])))
        v.positive_int("training.optimizer.muon_ns_steps", self.muon_ns_steps)
        v.boolean("training.optimizer.precision_aware", self.precision_aware)
        for name, allowed in (("main_grads", ("fp32", "bf16")), ("main_params", ("fp32", "fp16")),
                              ("exp_avg", tuple(STATE_NBYTES)), ("exp_avg_sq", tuple(STATE_NBYTES))):
            value = v.one_of(f"training.optimizer.{name}", getattr(self, name), list(allowed))
            if value != "fp32" and not self.precision_aware:
                raise ConfigError(f"training.optimizer.{name} {value} requires training.optimizer.precision_aware "
                                  f"(megatron-core keeps optimizer state in fp32 otherwise)")
        if self.precision_aware and self.kind is not OptimizerKind.ADAM:
            raise ConfigError(f"training.optimizer.precision_aware requires kind adam (got {self.kind.value}): "
                              f"only TransformerEngine's FusedAdam keeps state in other dtypes")

    def main_param_nbytes(self, model_nbytes: int) -> int:
        """Bytes of the main (master) copy of a parameter whose model dtype has ``model_nbytes``: none
        for an fp32 model; with the precision-aware optimizer and fp32 main params of a 2-byte model, the
        16 low bits only (TE's ``store_param_remainders``, on by default: the high 16 are the bf16
        weight itself)."""
        if model_nbytes >= 4:
            return 0
        if self.precision_aware and self.main_params == "fp32" and model_nbytes == 2:
            return 2
        return STATE_NBYTES[self.main_params]

    def adam_state_nbytes(self) -> int:
        """Adam's two moments per parameter."""
        return STATE_NBYTES[self.exp_avg] + STATE_NBYTES[self.exp_avg_sq]

    def state_nbytes(self, model_nbytes: int, *, matrix: bool) -> int:
        """Optimizer state per parameter (main copy and the optimizer's buffers); ``matrix``: a 2-D
        weight of a layer, which Muon steps with one fp32 momentum buffer."""
        main = self.main_param_nbytes(model_nbytes)
        if self.kind is OptimizerKind.SGD or (self.kind is OptimizerKind.MUON and matrix):
            return main + STATE_NBYTES["fp32"]
        return main + self.adam_state_nbytes()

    def adam_step_nbytes(self) -> int:
        """Bytes Adam's multi-tensor pass moves per parameter: the main gradient read, the main
        parameter and both moments read and written (28 in fp32); a remainder-stored main parameter
        is read and written with its bf16 half, 4 bytes either way."""
        return STATE_NBYTES[self.main_grads] + 2 * (STATE_NBYTES[self.main_params] + self.adam_state_nbytes())

    def sgd_step_nbytes(self) -> int:
        """Bytes a momentum step moves per parameter: gradient read, main parameter and fp32 momentum
        read and written (20 in fp32)."""
        return STATE_NBYTES[self.main_grads] + 2 * (STATE_NBYTES[self.main_params] + STATE_NBYTES["fp32"])
