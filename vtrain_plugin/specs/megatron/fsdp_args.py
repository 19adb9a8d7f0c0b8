"""The fully sharded data parallelism a Megatron-LM command line asks for, as ``TrainingSpec.fsdp``.

``--use-megatron-fsdp`` (``--use-custom-fsdp`` before 0.14) or ``--use-torch-fsdp2`` turn it on;
``--data-parallel-sharding-strategy``, ``--fsdp-double-buffer``, ``--suggested-communication-unit-size``
and ``--torch-fsdp2-no-reshard-after-forward`` tune it. Why here and not in the flag table: these
flags decide one setting together, and some of them mean something only with FSDP on.
"""

from __future__ import annotations

from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.fsdp import FsdpImplementation, FsdpSettings, ShardingStrategy
from vtrain_plugin.specs.megatron.flag_values import positive_int
from vtrain_plugin.specs.megatron.model import Given

MEGATRON_FSDP_FLAGS = ("--use-megatron-fsdp", "--use-custom-fsdp")
TORCH_FSDP_FLAG = "--use-torch-fsdp2"
STRATEGY_FLAG = "--data-parallel-sharding-strategy"
INSTANCES_FLAG = "--num-distributed-optimizer-instances"
# Flags that tune Megatron-FSDP or torch FSDP2 and mean nothing without them.
_TUNING_FLAGS = {"--fsdp-double-buffer": "megatron", "--suggested-communication-unit-size": "megatron",
                 "--outer-dp-sharding-strategy": "megatron", "--enable-full-sharding-in-hsdp": "megatron",
                 "--torch-fsdp2-no-reshard-after-forward": "torch", "--megatron-fsdp-grad-comm-dtype": "megatron",
                 "--megatron-fsdp-main-grads-dtype": "megatron", "--megatron-fsdp-main-params-dtype": "megatron"}
GRAD_COMM_FLAG = "--megatron-fsdp-grad-comm-dtype"
# Megatron-FSDP's buffer dtypes at what vtrain prices (fp32 main weights; main grads in the run's
# gradient dtype, fp32 for bf16 / fp16 models without --grad-reduce-in-bf16); other values are refused.
MAIN_GRADS_FLAG, MAIN_PARAMS_FLAG = "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-main-params-dtype"


def checked_only(flag: str, value: Any) -> Any:
    """The FlagField converter of the flags :func:`fsdp_settings` reads: None (nothing for the table
    to set)."""
    return None


def fsdp_settings(given: Given) -> FsdpSettings | None:
    """The FSDP settings of the command line ``given``; None when it runs DDP."""
    megatron = next((flag for flag in MEGATRON_FSDP_FLAGS if given.get(flag)), None)
    torch = bool(given.get(TORCH_FSDP_FLAG))
    instances = positive_int(INSTANCES_FLAG, given.get(INSTANCES_FLAG, 1))
    if megatron and torch:
        raise ConfigError(f"{megatron} with {TORCH_FSDP_FLAG}: one FSDP implementation at a time")
    implementation = "megatron" if megatron else "torch" if torch else None
    for flag, needs in _TUNING_FLAGS.items():
        if given.get(flag) and implementation != needs:
            owner = "--use-megatron-fsdp" if needs == "megatron" else TORCH_FSDP_FLAG
            raise ConfigError(f"{flag} needs {owner}")
    if instances > 1 and implementation:
        raise ConfigError(f"{INSTANCES_FLAG} {instances}: HSDP (FSDP inside replicas) is not modelled by vtrain yet")
    if instances > 1 and not given.get("--use-distributed-optimizer"):
        raise ConfigError(f"{INSTANCES_FLAG} {instances} needs --use-distributed-optimizer (megatron-core asserts "
                          f"a partial distributed optimizer is a distributed optimizer)")
    if implementation is None:  # Megatron-LM reads the sharding strategy only with FSDP
        return None
    if implementation == "torch":
        return FsdpSettings(implementation=FsdpImplementation.TORCH,
                            reshard_after_forward=not given.get("--torch-fsdp2-no-reshard-after-forward"))
    strategy = given.get(STRATEGY_FLAG, ShardingStrategy.OPTIM_GRADS_PARAMS.value)
    if strategy not in [s.value for s in ShardingStrategy]:
        raise ConfigError(f"{STRATEGY_FLAG} must be one of {', '.join(s.value for s in ShardingStrategy)}, "
                          f"got {strategy!r}")
    unit = "--suggested-communication-unit-size"
    _check_buffer_dtypes(given)
    comm = given.get(GRAD_COMM_FLAG, "auto")
    if comm not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"{GRAD_COMM_FLAG} must be one of fp32, fp16, bf16, auto, got {comm!r}")
    return FsdpSettings(implementation=FsdpImplementation.MEGATRON, sharding_strategy=ShardingStrategy(strategy),
                        double_buffer=bool(given.get("--fsdp-double-buffer")),
                        communication_unit_elements=positive_int(unit, given[unit]) if unit in given else None,
                        grad_comm_dtype=None if comm == "auto" else comm)


def _check_buffer_dtypes(given: Given) -> None:
    """Refuse Megatron-FSDP buffer dtypes other than those vtrain prices (see MAIN_GRADS_FLAG)."""
    grads = "bf16" if given.get("--grad-reduce-in-bf16") else "fp32"
    for flag, priced in ((MAIN_GRADS_FLAG, ("auto", grads)), (MAIN_PARAMS_FLAG, ("fp32",))):
        if given.get(flag, priced[0]) not in priced:
            raise ConfigError(f"{flag} {given[flag]}: vtrain prices Megatron-FSDP's buffer in "
                              f"{' or '.join(priced)} only")
