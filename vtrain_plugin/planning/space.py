"""The plans a search evaluates: the one place that enumerates parallel layouts and training options.

A :class:`SearchSpace` pins each axis to a tuple of values or leaves it ``None`` for its default
range. The axes form an ordered table, :data:`AXES`; an axis's default range may depend on the
values already chosen for the axes before it:

=================  ==================================================================================
tensor_parallel    divisors of num_attention_heads that are <= max_tp and keep the layout rules
                   (divide num_query_groups and the FFN size); max_tp defaults to the GPUs per node,
                   raised to the largest pinned size (``--tp 16`` tries 16 on 8-GPU nodes)
context_parallel   1 only: context parallelism pays off for long sequences alone, and each size
                   tried multiplies the search, so sizes > 1 are tried when pinned (``--cp 1,2,4``)
pipeline_parallel  divisors of num_layers
data_parallel      every DP size that puts TP x CP x PP x DP in the GPU budget
expert_parallel    1 for a dense model; for a MoE model, the divisors of num_experts whose expert ranks
                   (EP x expert TP, expert TP being TP) fit in the TP x CP x DP ranks of a stage
micro_batch_size   divisors of the per-replica batch, global_batch / DP
virtual_pipeline   1, plus every divisor v > 1 of layers / PP when PP > 1 (interleaved 1F1B then)
sequence_parallel  off, plus on when TP > 1 and TP divides seq_length / CP
recompute          none, selective, full
grad_reduce        after_backward, overlap
software_stack     the base training spec's (none given: each plan's default, TrainingSpec.stack_for);
                   CP > 1 only with megatron_core_te
fp8                the base training spec's (off unless the plan file sets training.fp8); ``off``,
                   ``hybrid`` and ``e4m3`` can be pinned, FP8 only with megatron_core_te
distributed_opt.   off, plus on when DP > 1 (with grad_reduce overlap it overlaps the parameter
                   all-gather too: overlap_param_gather, as Megatron-Core recipes set them together)
=================  ==================================================================================

Each combination of values is checked against :data:`RULES`, in that order (the axes' rules, axis
by axis). A combination that breaks one is skipped and counted once, under the first rule it
breaks; the enumeration stops at the first axis that breaks a rule, so a skipped count is the
number of combinations of the *pinned* values of the later axes (an unpinned later axis counts
once: its range depends on the values before it). An unpinned axis whose default range is empty
for the values before it (no DP size puts the GPU count in the budget; DP does not divide the
global batch, so no micro-batch size does) counts that prefix under the axis's first rule.
Plans beyond the input limits of :mod:`vtrain_plugin.specs.limits` (micro-batch size and tokens,
micro-batches, scheduled passes) are skipped under the ``... beyond limits`` rules.

Adding an axis is one entry in
:data:`AXES` and one field of :class:`SearchSpace`, named like the :class:`ParallelPlan` or
:class:`TrainingSpec` field it sets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.planning.budget import GpuBudget
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.limits import (GLOBAL_BATCH_SIZE, MICRO_BATCH_SIZE, MICRO_BATCH_TOKENS, MICRO_BATCHES,
                                        SCHEDULED_PASSES)
from vtrain_plugin.specs.parallel import LAYOUT_RULES, ParallelPlan, Recompute
from vtrain_plugin.specs.training import Fp8Format, GradReduce, ScheduleKind, SoftwareStack, TrainingSpec

# ---------------------------------------------------------------------------------------------
# Values of an axis


@dataclass(frozen=True, slots=True)
class ValueKind:
    """What one value of an axis is: ``convert`` takes the value or its text (the CLI's) and
    raises ValueError when it is not one."""

    description: str
    convert: Callable[[Any], Any]


def _positive_int(value: Any) -> int:
    if isinstance(value, str):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(value)
    return value


_SWITCH_TEXT = {"on": True, "off": False, "true": True, "false": False}


def _switch(value: Any) -> bool:
    if isinstance(value, str):
        return _SWITCH_TEXT[value.strip().lower()]
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


def _choice(enum: type[StrEnum]) -> ValueKind:
    return ValueKind(f"one of {', '.join(e.value for e in enum)}", lambda value: enum(str(value).strip()))


def _fp8(value: Any) -> Fp8Format | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    return Fp8Format(str(value).strip())


POSITIVE_INT = ValueKind("a positive integer", _positive_int)
SWITCH = ValueKind("on or off", _switch)
FP8 = ValueKind(f"off or one of {', '.join(f.value for f in Fp8Format)}", _fp8)


# ---------------------------------------------------------------------------------------------
# Rules and axes


@dataclass(frozen=True, slots=True)
class _Context:
    model: ModelSpec
    global_batch_size: int
    budget: GpuBudget
    max_tp: int
    training: TrainingSpec  # the base of each plan's training spec
    plans: dict[tuple, ParallelPlan] = field(default_factory=dict)  # plan values -> plan, built once

    def plan(self, prefix: Prefix) -> ParallelPlan:
        """The plan of the plan fields of ``prefix``: one object per distinct set of values, as
        many prefixes (and the rules of several axes) share them."""
        key = tuple((name, value) for name, value in prefix.items() if name in _PLAN_FIELDS)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = ParallelPlan(**dict(key))
        return plan


Prefix = Mapping[str, Any]  # axis name -> value, for the axes chosen so far


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule a combination keeps; ``name`` is the short label skipped plans are counted under."""

    name: str
    broken: Callable[[_Context, Prefix], bool]


_PLAN_FIELDS = frozenset(f.name for f in fields(ParallelPlan))


def _layout_rule(name: str) -> Rule:
    """One of :data:`LAYOUT_RULES` (the rules of ``ParallelPlan.check_fits``) on the values so far."""
    (rule,) = (r for r in LAYOUT_RULES if r.name == name)
    return Rule(name, lambda ctx, c: rule.broken(ctx.plan(c), ctx.model))


def _microbatches(ctx: _Context, c: Prefix) -> int:
    return ctx.global_batch_size // (c["data_parallel"] * c["micro_batch_size"])


@dataclass(frozen=True, slots=True)
class Axis:
    name: str  # the SearchSpace field, named like the ParallelPlan or TrainingSpec field it sets
    flag: str  # short name: in rule labels and the CLI option (--tp)
    label: str  # what its values are, for help texts
    kind: ValueKind
    default: Callable[[_Context, Prefix], tuple[Any, ...]]  # the range when unpinned
    rules: tuple[Rule, ...] = ()  # checked, in order, once this axis has its value
    default_label: str = "every valid one"  # what ``default`` gives, for help texts

    def values(self, raw: Iterable[Any], *, where: str) -> tuple[Any, ...]:
        """Pinned values (or their texts), converted, duplicates dropped; errors name ``where``."""
        out: list[Any] = []
        for item in raw:
            try:
                value = self.kind.convert(item)
            except (ValueError, LookupError, TypeError):
                raise ConfigError(f"{where}: {item!r} is not {self.kind.description}") from None
            if value not in out:
                out.append(value)
        if not out:
            raise ConfigError(f"{where}: give at least one value")
        return tuple(out)


def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))


def _keeping(axis_rules: tuple[Rule, ...], name: str, candidates: Callable[[_Context, Prefix], Iterable[Any]]
             ) -> Callable[[_Context, Prefix], tuple[Any, ...]]:
    """A default range: the candidates that break none of the axis's rules."""
    def default(ctx: _Context, c: Prefix) -> tuple[Any, ...]:
        return tuple(x for x in candidates(ctx, c)
                     if not any(r.broken(ctx, {**c, name: x}) for r in axis_rules))
    return default


_TP_RULES = (
    Rule("tp > max_tp", lambda ctx, c: c["tensor_parallel"] > ctx.max_tp),
    _layout_rule("heads % tp"),
    _layout_rule("query groups % tp"),
    _layout_rule("ffn % tp"),
    _layout_rule("mamba heads % tp"),
    _layout_rule("mamba groups % tp"),
)
_SP_RULES = (
    Rule("sp needs tp > 1", lambda ctx, c: c["sequence_parallel"] and c["tensor_parallel"] == 1),
    _layout_rule("seq % tp (sp)"),
    _layout_rule("seq/cp % tp (sp)"),
    _layout_rule("moe tp needs sp"),
)
_CP_RULES = (_layout_rule("seq % cp"), _layout_rule("seq % (2*cp)"), _layout_rule("hybrid cp"))
_EP_RULES = tuple(_layout_rule(name) for name in ("ep needs moe", "experts % ep", "(tp*cp*dp) % (ep*etp)",
                                                  "moe ffn % etp", "moe bias needs etp 1"))


def _model_parallel(c: Prefix) -> int:
    """GPUs of one model replica: TP x CP x PP."""
    return c["tensor_parallel"] * c["context_parallel"] * c["pipeline_parallel"]


AXES: tuple[Axis, ...] = (
    Axis("tensor_parallel", "tp", "tensor-parallel sizes", POSITIVE_INT,
         _keeping(_TP_RULES, "tensor_parallel", lambda ctx, c: _divisors(ctx.model.num_attention_heads)),
         _TP_RULES),
    Axis("context_parallel", "cp", "context-parallel sizes", POSITIVE_INT, lambda ctx, c: (1,), _CP_RULES,
         default_label="1"),
    Axis("pipeline_parallel", "pp", "pipeline-parallel sizes", POSITIVE_INT,
         lambda ctx, c: _divisors(ctx.model.num_layers),
         (_layout_rule("layers % pp"),)),
    Axis("data_parallel", "dp", "data-parallel sizes", POSITIVE_INT,
         lambda ctx, c: ctx.budget.data_parallel_sizes(_model_parallel(c)),
         (Rule("gpus not in budget", lambda ctx, c: _model_parallel(c) * c["data_parallel"] not in ctx.budget),)),
    Axis("expert_parallel", "ep", "expert-parallel sizes (MoE models)", POSITIVE_INT,
         _keeping(_EP_RULES, "expert_parallel",
                  lambda ctx, c: _divisors(ctx.model.num_experts) if ctx.model.is_moe else (1,)),
         _EP_RULES),
    Axis("micro_batch_size", "micro_batch", "micro-batch sizes", POSITIVE_INT,
         lambda ctx, c: (() if ctx.global_batch_size % c["data_parallel"]
                         else _divisors(ctx.global_batch_size // c["data_parallel"])),
         (Rule("global_batch % (dp*micro_batch)",
               lambda ctx, c: ctx.global_batch_size % (c["data_parallel"] * c["micro_batch_size"]) != 0),
          Rule("micro_batch beyond limits",
               lambda ctx, c: (c["micro_batch_size"] > MICRO_BATCH_SIZE.maximum
                               or c["micro_batch_size"] * ctx.model.seq_length > MICRO_BATCH_TOKENS.maximum)),
          Rule("micro-batches beyond limits", lambda ctx, c: _microbatches(ctx, c) > MICRO_BATCHES.maximum))),
    Axis("virtual_pipeline", "vp", "model chunks per pipeline rank (interleaved 1F1B when > 1)", POSITIVE_INT,
         lambda ctx, c: (1,) if c["pipeline_parallel"] == 1 else
         (1, *(d for d in _divisors(ctx.model.num_layers // c["pipeline_parallel"]) if d > 1)),
         (Rule("vp needs pp > 1", lambda ctx, c: c["virtual_pipeline"] > 1 and c["pipeline_parallel"] == 1),
          _layout_rule("layers % (pp*vp)"),
          _layout_rule("hybrid vp"),
          Rule("num_microbatches % pp (interleaved)",
               lambda ctx, c: c["virtual_pipeline"] > 1 and _microbatches(ctx, c) % c["pipeline_parallel"] != 0),
          Rule("scheduled passes beyond limits",
               lambda ctx, c: (_microbatches(ctx, c) * c["pipeline_parallel"] * c["virtual_pipeline"]
                               > SCHEDULED_PASSES.maximum)))),
    Axis("sequence_parallel", "sp", "sequence parallelism: on, off", SWITCH,
         _keeping(_SP_RULES, "sequence_parallel", lambda ctx, c: (False, True)),
         _SP_RULES),
    Axis("recompute", "recompute", "activation recompute: none, selective, full", _choice(Recompute),
         lambda ctx, c: tuple(Recompute)),
    Axis("grad_reduce", "grad_reduce", "data-parallel gradient reduction: after_backward, overlap",
         _choice(GradReduce), lambda ctx, c: tuple(GradReduce)),
    Axis("software_stack", "stack", "software stacks: " + ", ".join(s.value for s in SoftwareStack),
         _choice(SoftwareStack), lambda ctx, c: (ctx.training.software_stack,),
         (Rule("cp needs megatron_core_te", lambda ctx, c: c["context_parallel"] > 1
               and c["software_stack"] not in (None, SoftwareStack.MEGATRON_CORE_TE)),),
         default_label="each plan's default stack unless the plan file names one"),
    Axis("fp8", "fp8", "FP8 GEMMs: off, " + ", ".join(f.value for f in Fp8Format), FP8,
         lambda ctx, c: (ctx.training.fp8,),
         (Rule("fp8 needs megatron_core_te", lambda ctx, c: c["fp8"] is not None
               and c["software_stack"] not in (None, SoftwareStack.MEGATRON_CORE_TE)),),
         default_label="off unless the plan file sets training.fp8"),
    Axis("distributed_optimizer", "dist_opt", "distributed optimizer (ZeRO-1): on, off", SWITCH,
         lambda ctx, c: (False,) if c["data_parallel"] == 1 else (False, True)),
)
RULES: tuple[str, ...] = tuple(rule.name for axis in AXES for rule in axis.rules)


# ---------------------------------------------------------------------------------------------
# The space and its enumeration


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """Each axis: ``None`` (its whole valid range, see the module doc) or the values to try."""

    tensor_parallel: tuple[int, ...] | None = None
    context_parallel: tuple[int, ...] | None = None
    pipeline_parallel: tuple[int, ...] | None = None
    data_parallel: tuple[int, ...] | None = None
    expert_parallel: tuple[int, ...] | None = None
    micro_batch_size: tuple[int, ...] | None = None
    virtual_pipeline: tuple[int, ...] | None = None
    sequence_parallel: tuple[bool, ...] | None = None
    recompute: tuple[Recompute, ...] | None = None
    grad_reduce: tuple[GradReduce, ...] | None = None
    software_stack: tuple[SoftwareStack, ...] | None = None
    fp8: tuple[Fp8Format | None, ...] | None = None
    distributed_optimizer: tuple[bool, ...] | None = None
    max_tp: int | None = None  # largest TP tried; None: the cluster's GPUs per node

    def __post_init__(self) -> None:
        for axis in AXES:
            raw = getattr(self, axis.name)
            if raw is not None:
                if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
                    raw = (raw,)
                object.__setattr__(self, axis.name, axis.values(raw, where=f"search.{axis.name}"))
        if self.max_tp is not None:
            v.positive_int("search.max_tp", self.max_tp)

    def tp_limit(self, gpus_per_node: int) -> int:
        """The largest TP tried: ``max_tp`` when given (pinned sizes above it are skipped), else the
        GPUs per node raised to the largest pinned TP (a pinned size is tried, not skipped under a
        default limit the user never set)."""
        if self.max_tp is not None:
            return self.max_tp
        return max((gpus_per_node, *(self.tensor_parallel or ())))


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One plan to evaluate: the layout and the training spec it runs with."""

    parallel: ParallelPlan
    training: TrainingSpec

    @property
    def num_gpus(self) -> int:
        return self.parallel.world_size


@dataclass(frozen=True, slots=True, kw_only=True)
class Enumeration:
    candidates: tuple[Candidate, ...]
    skipped: dict[str, int]  # rule -> combinations skipped, in the order of RULES, zero counts left out

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


def format_skipped(skipped: Mapping[str, int]) -> str:
    """``"heads % tp: 4, gpus not in budget: 2"``."""
    return ", ".join(f"{rule}: {count:,}" for rule, count in skipped.items()) or "none"


def enumerate_plans(model: ModelSpec, space: SearchSpace, *, global_batch_size: int,
                    budget: GpuBudget, training: TrainingSpec, gpus_per_node: int) -> Enumeration:
    """Every valid plan of ``space`` for ``model`` within ``budget``, in axis order, with the skip
    counts by rule (see the module doc). ``training`` is the base of each plan's training spec
    (schedule, bucket size, software stack): its global batch is replaced by ``global_batch_size``;
    plans with a virtual pipeline run the interleaved 1F1B schedule, the others the base's schedule
    (1F1B when that is the interleaved one). Raises ConfigError when no plan is valid."""
    GLOBAL_BATCH_SIZE.positive_int("global_batch_size", global_batch_size)
    ctx = _Context(model=model, global_batch_size=global_batch_size, budget=budget,
                   max_tp=space.tp_limit(gpus_per_node), training=training)
    pinned = [getattr(space, axis.name) for axis in AXES]
    later_pinned = [math.prod(len(p) for p in pinned[i + 1:] if p is not None) for i in range(len(AXES))]
    skipped = dict.fromkeys(RULES, 0)
    found: list[dict[str, Any]] = []
    prefix: dict[str, Any] = {}

    def walk(i: int) -> None:
        if i == len(AXES):
            found.append(dict(prefix))
            return
        axis = AXES[i]
        values = pinned[i] if pinned[i] is not None else axis.default(ctx, prefix)
        if not values:
            skipped[axis.rules[0].name] += later_pinned[i]
            return
        for value in values:
            prefix[axis.name] = value
            broken = next((rule.name for rule in axis.rules if rule.broken(ctx, prefix)), None)
            if broken is None:
                walk(i + 1)
            else:
                skipped[broken] += later_pinned[i]
        del prefix[axis.name]

    walk(0)
    skipped = {rule: count for rule, count in skipped.items() if count}
    if not found:
        raise ConfigError(f"no valid plan: {sum(skipped.values()):,} skipped ({format_skipped(skipped)})")
    base = replace(training, global_batch_size=global_batch_size)
    specs: dict[tuple, TrainingSpec] = {}
    candidates = []
    for values in found:
        plan = ctx.plan(values)
        training_values = {k: x for k, x in values.items() if k not in _PLAN_FIELDS}
        schedule = _schedule(base.schedule, values["virtual_pipeline"])
        key = (schedule, *training_values.items())
        if key not in specs:
            overlap = training_values["distributed_optimizer"] and training_values["grad_reduce"] is GradReduce.OVERLAP
            specs[key] = replace(base, schedule=schedule, overlap_param_gather=overlap, **training_values)
        candidates.append(Candidate(parallel=plan, training=specs[key]))
    return Enumeration(candidates=tuple(candidates), skipped=skipped)


def _schedule(base: ScheduleKind, virtual_pipeline: int) -> ScheduleKind:
    if virtual_pipeline > 1:
        return ScheduleKind.INTERLEAVED_1F1B
    return ScheduleKind.ONE_F_ONE_B if base is ScheduleKind.INTERLEAVED_1F1B else base
