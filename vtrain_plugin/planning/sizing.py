"""``size_model()``: the largest model of a family that trains compute-optimally within a budget.

Each shape of the family ladder (:mod:`vtrain_plugin.planning.model_family`) is given its Chinchilla
token count; :func:`~vtrain_plugin.planning.search.search` finds its plans on the cluster within the
GPU budget, and the shape is *within budget* when a plan that fits in memory trains it in at most
``days`` and for at most ``budget_usd`` (whichever are given; the fastest such plan is reported).
Days to train grow with the shape (tokens and FLOPs per token both grow with the parameter count),
so the ladder is bisected: about ``log2(len(ladder))`` searches, each on a shape's own traces; the
smallest shape is searched only when no larger one is within budget (else it cannot change the answer).
With a budget in days alone a shape needs only its fastest plan, so its search is best-first
(:mod:`~vtrain_plugin.planning.bounded`: the plans that cannot be faster are never traced nor
costed), and a shape whose every plan's floor exceeds the days is over budget without a trace (its
row then gives that floor, not a plan); a dollar budget also needs the cheapest plan, and its
searches cost every plan.

The result also carries the naive answer, the largest shape whose ``6 N D`` FLOPs fit the budget at
a fixed MFU (:func:`~vtrain_plugin.planning.model_family.naive_size`; a dollar budget buys GPU-hours at
the cluster's price), and vtrain's days for that
shape: the vTrain paper's point is that the fixed-MFU answer overshoots the budget.

Days and dollars are the expected ones, failures, restarts and checkpoints counted
(:mod:`vtrain_plugin.sim.goodput`), unless ``reliability`` is None.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import SECONDS_PER_DAY, SECONDS_PER_HOUR
from vtrain_plugin.hardware.devices import get_device
from vtrain_plugin.planning.model_family import (CHINCHILLA_TOKENS_PER_PARAMETER, HIDDEN_STEP, NaiveSize,
                                                 chinchilla_tokens, describe_ladder, family_shapes, naive_size)
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import GpuBudget, SearchSpace
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.specs.model import Family, ModelSpec
from vtrain_plugin.specs.reliability import ReliabilitySpec
from vtrain_plugin.specs.training import TrainingSpec

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

DEFAULT_BATCH_TOKENS = 2**22  # ~4M tokens per iteration, as Llama 2 and (3.1M) GPT-3 175B trained
DEFAULT_NAIVE_MFU = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeOutcome:
    """One shape of the ladder: its tokens, its chosen plan (a row of its search), and the verdict."""

    model: ModelSpec
    tokens: float
    plan: dict[str, Any] | None = field(default=None, repr=False)  # None: no plan fits in memory
    within_budget: bool
    reason: str  # why not within budget ("" when it is)
    no_plan: bool = False  # no valid plan at all within the GPU budget (rather than over days or dollars)
    # Set when no plan was costed because every plan's floor on the days exceeds the days budget
    # (planning/bounded.py): at least this many days; ``plan`` is then None.
    floor_days: float | None = None

    @property
    def train_days(self) -> float:
        """Expected with failures when the search counted them, else failure-free."""
        return math.nan if self.plan is None else float(self.plan[days_column(self.plan)])

    @property
    def train_cost_usd(self) -> float:
        return math.nan if self.plan is None else float(self.plan[cost_column(self.plan)])

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan or {}
        return {
            "model": self.model.name, "num_parameters": self.model.num_parameters,
            "num_layers": self.model.num_layers, "hidden_size": self.model.hidden_size,
            "num_attention_heads": self.model.num_attention_heads, "tokens": self.tokens,
            **{key: plan.get(key) for key in ("tensor_parallel", "pipeline_parallel", "data_parallel",
                                              "micro_batch_size", "recompute", "num_gpus", "mfu",
                                              "iteration_time_ms")},
            "train_days": None if self.plan is None else self.train_days,
            "train_cost_usd": None if self.plan is None or math.isnan(self.train_cost_usd) else self.train_cost_usd,
            "ideal_train_days": plan.get("train_days"), "goodput": plan.get("goodput"),
            "within_budget": self.within_budget, "reason": self.reason, "floor_days": self.floor_days,
        }


def days_column(row: Any) -> str:
    """The days-to-train column of a search row: expected with failures when it has them."""
    return "expected_train_days" if "expected_train_days" in row else "train_days"


def cost_column(row: Any) -> str:
    return "expected_train_cost_usd" if "expected_train_cost_usd" in row else "train_cost_usd"


@dataclass(frozen=True, slots=True, kw_only=True)
class SizingResult:
    answer: ShapeOutcome  # the largest shape within budget
    evaluated: tuple[ShapeOutcome, ...]  # every shape searched, by parameter count
    naive: NaiveSize | None  # the fixed-MFU answer, in the days and/or dollars of the budget
    naive_outcome: ShapeOutcome | None  # vtrain's verdict on the naive answer
    days: float | None
    budget_usd: float | None
    naive_mfu: float

    def table(self) -> pd.DataFrame:
        """One row per evaluated shape, with ``answer`` / ``naive`` marking the two answers."""
        import pandas as pd  # loaded when a table is asked for: the CLI imports this module for every command

        rows = [{**o.to_dict(), "answer": o.model == self.answer.model,
                 "naive": self.naive is not None and o.model == self.naive.model} for o in self.evaluated]
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        model = self.answer.model
        ladder = {"family": model.family.value, "vocab_size": model.vocab_size, "seq_length": model.seq_length,
                  "num_query_groups": model.num_query_groups, "num_experts": model.num_experts,
                  "moe_router_topk": model.moe_router_topk if model.num_experts is None else model.router_topk,
                  "dtype": model.dtype.value, "description": describe_ladder(model)}
        return {"days": self.days, "budget_usd": self.budget_usd, "ladder": ladder, "answer": self.answer.to_dict(),
                "naive": None if self.naive is None else {
                    **self.naive_outcome.to_dict(), "naive_mfu": self.naive_mfu,
                    "naive_flops": self.naive.flops, "budget_flops": self.naive.budget_flops},
                "evaluated": [o.to_dict() for o in self.evaluated]}


def size_model(family: Family | str, *, cluster: ClusterSpec, gpus: GpuBudget | int | str | Iterable[int],
               days: float | None = None, budget_usd: float | None = None,
               tokens_per_parameter: float = CHINCHILLA_TOKENS_PER_PARAMETER,
               batch_tokens: int = DEFAULT_BATCH_TOKENS, naive_mfu: float = DEFAULT_NAIVE_MFU,
               min_params: float = 1e9, max_params: float = 2e12, hidden_step: int = HIDDEN_STEP,
               space: SearchSpace | None = None, workers: int | None = None, progress: bool = False,
               reliability: ReliabilitySpec | None = ReliabilitySpec(),
               profile_db: str | None | Literal[False] = None, vocab_size: int | None = None,
               seq_length: int | None = None, num_query_groups: int | None = None,
               num_experts: int | None = None, moe_router_topk: int | None = None) -> SizingResult:
    """The largest ``family`` shape (``min_params`` .. ``max_params`` parameters) that trains on
    ``tokens_per_parameter`` tokens per parameter within ``days`` and/or ``budget_usd`` on ``gpus``
    GPUs of ``cluster`` (see the module doc). ``batch_tokens``: tokens per iteration, rounded down
    to whole sequences. ``space`` restricts each shape's search (default: every valid plan).
    ``reliability``: the failures, restarts and checkpoints the days and dollars count (None: off).
    ``profile_db``: the profile database of the estimates (see :func:`~vtrain_plugin.estimate.estimate`).
    ``vocab_size``, ``seq_length``, ``num_query_groups`` (``MHA``: multi-head attention), ``num_experts``
    and ``moe_router_topk``: the ladder's (:func:`~vtrain_plugin.planning.model_family.family_shape`;
    None: the family's)."""
    if days is None and budget_usd is None:
        raise ConfigError("size: give a budget: days and/or budget_usd")
    if days is not None:
        days = v.positive_number("days", days)
    if budget_usd is not None:
        budget_usd = v.positive_number("budget_usd", budget_usd)
        if cluster.price_per_gpu_hour_usd is None:
            raise ConfigError(f"budget_usd needs a price: cluster {cluster.name or cluster.gpu!r} has no "
                              f"price_per_gpu_hour_usd")
    v.positive_number("tokens_per_parameter", tokens_per_parameter)
    v.positive_int("batch_tokens", batch_tokens)
    if not 0 < naive_mfu <= 1:
        raise ConfigError(f"naive_mfu must lie in (0, 1], got {naive_mfu!r}")
    budget = GpuBudget.of(gpus)
    settings = {"vocab_size": vocab_size, "seq_length": seq_length, "num_query_groups": num_query_groups,
                "num_experts": num_experts, "moe_router_topk": moe_router_topk}
    shapes = family_shapes(family, min_params=min_params, max_params=max_params, hidden_step=hidden_step,
                           **settings)
    if not shapes:
        raise ConfigError(f"size: no {family} shape has between {min_params:.3g} and {max_params:.3g} parameters "
                          f"(hidden step {hidden_step})")
    outcomes: dict[int, ShapeOutcome] = {}

    def judge(model: ModelSpec) -> ShapeOutcome:
        key = model.num_parameters
        if key not in outcomes:
            outcomes[key] = _judge(model, cluster=cluster, budget=budget, days=days, budget_usd=budget_usd,
                                   tokens_per_parameter=tokens_per_parameter, batch_tokens=batch_tokens,
                                   space=space, workers=workers, progress=progress, reliability=reliability,
                                   profile_db=profile_db)
            log.info("%s: %s", model.name, outcomes[key].reason or "within budget")
        return outcomes[key]

    answer = _bisect(shapes, judge)
    if answer is None:
        first = outcomes[shapes[0].num_parameters]
        if first.no_plan:
            raise ConfigError(_no_plan_message(shapes[0], budget, batch_tokens, first.reason))
        raise ConfigError(f"size: budget too small: the smallest shape, {shapes[0].name} "
                          f"({shapes[0].num_parameters / 1e9:.2f}B parameters), {first.reason}")
    peak = get_device(cluster.gpu).tensor_flop_per_ns(shapes[0].dtype) * 1e-3  # TFLOP/s
    most = max(budget.counts or (budget.high,))
    naive = naive_size(family, peak_tflop_per_s=peak, gpus=most,
                       days=naive_days(days, budget_usd, cluster.price_per_gpu_hour_usd, most),
                       mfu=naive_mfu, tokens_per_parameter=tokens_per_parameter, hidden_step=hidden_step,
                       **settings)
    naive_outcome = judge(naive.model)
    evaluated = tuple(outcomes[k] for k in sorted(outcomes))
    return SizingResult(answer=outcomes[shapes[answer].num_parameters], evaluated=evaluated, naive=naive,
                        naive_outcome=naive_outcome, days=days, budget_usd=budget_usd, naive_mfu=naive_mfu)


def _bisect(shapes: list[ModelSpec], judge: Callable[[ModelSpec], ShapeOutcome]) -> int | None:
    """The index in ``shapes`` of the largest shape ``judge`` finds within budget, None when not even
    the first is; by bisection, on the premise that days and dollars grow with the shape. The
    smallest shape is judged only when no larger one is within budget: otherwise, by the same
    premise, it is within budget too, and its search (the one of most plans that fit) cannot change
    the answer."""
    low, high = 0, len(shapes) - 1  # the answer, if any, lies in shapes[low..high]
    while low < high:  # shapes[low] was judged within budget, unless low is 0
        middle = (low + high + 1) // 2
        if judge(shapes[middle]).within_budget:
            low = middle
        else:
            high = middle - 1
    if low == 0 and not judge(shapes[0]).within_budget:
        return None
    return low


def naive_days(days: float | None, budget_usd: float | None, price_per_gpu_hour_usd: float | None,
               gpus: int) -> float:
    """The days of ``gpus`` GPUs the naive answer may spend: ``days``, the GPU-hours ``budget_usd``
    buys (``budget_usd / price / gpus / 24``), or the fewer of the two when both are given."""
    limits = [] if days is None else [days]
    if budget_usd is not None:
        limits.append(budget_usd / price_per_gpu_hour_usd / gpus * SECONDS_PER_HOUR / SECONDS_PER_DAY)
    return min(limits)


def _no_plan_message(model: ModelSpec, budget: GpuBudget, batch_tokens: int, reason: str) -> str:
    """Why not even the smallest shape has a plan: the arithmetic every plan must meet, the skip
    counts by rule, and what a count means."""
    global_batch = max(1, batch_tokens // model.seq_length)
    counts = (f"exactly {budget} GPUs (a count is exact; 1:{budget.counts[-1]} allows any count up to it)"
              if len(budget.counts) == 1 else f"a GPU count of {budget}")
    return (f"size: not a budget too small: no plan of the smallest shape, {model.name}, uses {counts}: "
            f"TP x CP x PP x DP must be such a count with DP x micro-batch dividing the global batch of "
            f"{global_batch:,} sequences ({batch_tokens:,} batch tokens // {model.seq_length:,} per sequence), "
            f"TP the {model.num_attention_heads} heads and PP the {model.num_layers} layers; {reason}")


def _judge(model: ModelSpec, *, cluster: ClusterSpec, budget: GpuBudget, days: float | None,
           budget_usd: float | None, tokens_per_parameter: float, batch_tokens: int, space: SearchSpace | None,
           workers: int | None, progress: bool, reliability: ReliabilitySpec | None,
           profile_db: str | None | Literal[False]) -> ShapeOutcome:
    tokens = chinchilla_tokens(model.num_parameters, tokens_per_parameter)
    global_batch = max(1, batch_tokens // model.seq_length)
    try:
        result = search(model, cluster=cluster, global_batch_size=global_batch, gpus=budget, space=space,
                        training=TrainingSpec(global_batch_size=global_batch, reliability=reliability),
                        objective="time", workers=workers, progress=progress, tokens=tokens,
                        profile_db=profile_db, top_k=1, exhaustive=budget_usd is not None,
                        give_up_above=days if budget_usd is None else None)
    except ConfigError as exc:  # no valid plan at all for this shape within the GPU budget
        return ShapeOutcome(model=model, tokens=tokens, within_budget=False, reason=str(exc), no_plan=True)
    if budget_usd is None and result.lowest_floor is not None and result.lowest_floor > days:
        return ShapeOutcome(model=model, tokens=tokens, within_budget=False, floor_days=result.lowest_floor,
                            reason=f"needs more than {result.lowest_floor:.3g} days > {days:g} (every plan's floor; "
                                   f"none costed)")
    fitting = result.table[result.table["fits_in_memory"]]
    if fitting.empty:
        return ShapeOutcome(model=model, tokens=tokens, within_budget=False,
                            reason="no plan fits in GPU memory")
    days_of, cost_of = days_column(fitting), cost_column(fitting)
    fastest = fitting.sort_values(days_of, kind="stable")
    meets = fastest
    if days is not None:
        meets = meets[meets[days_of] <= days]
    if budget_usd is not None:
        meets = meets[meets[cost_of] <= budget_usd]
    if not meets.empty:
        return ShapeOutcome(model=model, tokens=tokens, plan=meets.iloc[0].to_dict(), within_budget=True, reason="")
    best = fastest.iloc[0].to_dict()
    over = []
    if days is not None and best[days_of] > days:
        over.append(f"needs {best[days_of]:.3g} days > {days:g}")
    if budget_usd is not None:
        over.append(f"the cheapest plan costs ${fitting[cost_of].min():,.0f} > ${budget_usd:,.0f}")
    return ShapeOutcome(model=model, tokens=tokens, plan=best, within_budget=False,
                        reason=" and ".join(over) or "no plan meets both budgets at once")
