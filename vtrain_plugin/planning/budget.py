"""How many GPUs a plan may use: a count, a range or a list (``vtrain search --gpus``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.limits import WORLD_SIZE

_BUDGET_FORMS = "a GPU count (3360), a range LOW:HIGH (1024:4096) or a list (2240,2800,3360)"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuBudget:
    """How many GPUs a plan may use: one of ``counts``, or any number in ``[low, high]``."""

    counts: tuple[int, ...] = ()
    low: int | None = None
    high: int | None = None

    def __post_init__(self) -> None:
        if self.counts:
            if self.low is not None or self.high is not None:
                raise ConfigError("gpus: give counts or a range low:high, not both")
            object.__setattr__(self, "counts", tuple(sorted({WORLD_SIZE.positive_int("gpus", n) for n in self.counts})))
            return
        if self.low is None or self.high is None:
            raise ConfigError(f"gpus: give {_BUDGET_FORMS}")
        WORLD_SIZE.positive_int("gpus", self.low)
        WORLD_SIZE.positive_int("gpus", self.high)
        if self.low > self.high:
            raise ConfigError(f"gpus: the range {self.low}:{self.high} is empty (low > high)")

    @classmethod
    def parse(cls, text: str, *, where: str = "gpus") -> GpuBudget:
        """``"3360"``, ``"1024:4096"`` or ``"2240,2800,3360"``; errors name ``where``."""
        text = text.strip()
        try:
            if ":" in text:
                low, high = (int(part) for part in text.split(":"))
                parsed = {"low": low, "high": high}
            else:
                parsed = {"counts": tuple(int(part) for part in text.split(","))}
        except ValueError:
            raise ConfigError(f"{where}: {text!r} is not {_BUDGET_FORMS}") from None
        try:
            return cls(**parsed)
        except ConfigError as exc:
            raise ConfigError(where + str(exc).removeprefix("gpus")) from None

    @classmethod
    def of(cls, value: GpuBudget | int | str | Iterable[int]) -> GpuBudget:
        if isinstance(value, GpuBudget):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, int):
            return cls(counts=(value,))
        return cls(counts=tuple(value))

    def __contains__(self, num_gpus: int) -> bool:
        if self.counts:
            return num_gpus in self.counts
        return self.low <= num_gpus <= self.high

    def data_parallel_sizes(self, model_parallel: int) -> tuple[int, ...]:
        """Every DP size whose ``model_parallel x DP`` GPUs lie in the budget, ascending."""
        if self.counts:
            return tuple(n // model_parallel for n in self.counts if n % model_parallel == 0)
        return tuple(range(-(-self.low // model_parallel), self.high // model_parallel + 1))

    def __str__(self) -> str:
        return ",".join(map(str, self.counts)) if self.counts else f"{self.low}:{self.high}"
