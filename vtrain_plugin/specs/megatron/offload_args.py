"""The fine-grained activation offloading a Megatron-LM command line asks for, as
``TrainingSpec.activation_offload``.

``--fine-grained-activation-offloading`` turns it on; ``--offload-modules``,
``--activation-offload-fraction`` and ``--min-offloaded-tensor-size`` say what moves;
``--delay-offload-until-cuda-graph``, ``--fine-grained-offloading-max-inflight-offloads`` and
``--delta-offload-bytes-across-pp-ranks`` tune when. Why here and not in the flag table: these flags
decide one setting together, and the tuning ones mean something only with offloading on.
"""

from __future__ import annotations

from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.activation_offload import DEFAULT_MIN_TENSOR_ELEMENTS, ActivationOffload
from vtrain_plugin.specs.megatron.flag_values import non_negative_int, positive_int
from vtrain_plugin.specs.megatron.model import Given
from vtrain_plugin.specs.megatron.moe_flags import number

SWITCH = "--fine-grained-activation-offloading"
MODULES = "--offload-modules"
FRACTION = "--activation-offload-fraction"
MIN_SIZE = "--min-offloaded-tensor-size"
# Second-order: when the copies are launched (after a CUDA graph's replay; at most N not yet joined),
# not how many bytes move; listed as unmodelled.
TIMING_FLAGS = ("--delay-offload-until-cuda-graph", "--fine-grained-offloading-max-inflight-offloads")
PP_DELTA = "--delta-offload-bytes-across-pp-ranks"
READ_FLAGS = (SWITCH, MODULES, FRACTION, MIN_SIZE, *TIMING_FLAGS, PP_DELTA)


def activation_offload(given: Given, notes: list[str]) -> ActivationOffload | None:
    """The offloading of the command line ``given`` (None: off); the timing flags it gives are
    appended to ``notes`` (second-order, not modelled)."""
    if not given.get(SWITCH):
        tuning = next((f for f in READ_FLAGS[1:] if f in given and _active(f, given[f])), None)
        if tuning is not None:
            raise ConfigError(f"{tuning} needs {SWITCH} (Megatron-LM reads it only with offloading on)")
        return None
    modules = given.get(MODULES)
    words = [modules] if isinstance(modules, str) else list(modules or [])
    names = [w for word in words for w in str(word).split(",") if w]
    if not names:
        raise ConfigError(f"{SWITCH} needs {MODULES} (megatron-core asserts at least one module)")
    if non_negative_int(PP_DELTA, given.get(PP_DELTA, 0)):
        raise ConfigError(f"{PP_DELTA} {given[PP_DELTA]}: offload bytes balanced across pipeline ranks are not "
                          f"modelled by vtrain yet (every rank offloads the same share)")
    notes.extend(f"{flag} {given[flag]}".replace(" True", "") for flag in TIMING_FLAGS
                 if flag in given and _active(flag, given[flag]))
    fraction = number(FRACTION, given.get(FRACTION, 1.0))
    if not 0 < fraction <= 1:
        raise ConfigError(f"{FRACTION} ({fraction:g}) must lie in (0, 1]")
    try:
        return ActivationOffload(modules=tuple(names), fraction=fraction,
                                 min_tensor_elements=positive_int(MIN_SIZE, given.get(MIN_SIZE, DEFAULT_MIN_TENSOR_ELEMENTS)))
    except ConfigError as exc:
        raise ConfigError(f"{MODULES}: {exc}".replace("training.activation_offload.modules", "modules")) from None


def _active(flag: str, value: Any) -> bool:
    """Whether ``value`` differs from the flag's Megatron-LM default."""
    if flag == FRACTION:
        return number(flag, value) != 1.0
    if flag == MIN_SIZE:
        return positive_int(flag, value) != DEFAULT_MIN_TENSOR_ELEMENTS
    if flag == PP_DELTA:
        return non_negative_int(flag, value) != 0
    return value not in (None, False)


def checked_only(flag: str, value: Any) -> Any:
    """The FlagField converter of the flags :func:`activation_offload` reads: None."""
    return None
