"""How many transformer layers each pipeline rank and model chunk holds, as Megatron-Core builds them.

Megatron-Core 0.16 (``get_num_layers_to_build`` in ``transformer/transformer_block.py`` and the
checks of ``TransformerConfig.__post_init__``) splits the decoder's layers in one of three ways:

* evenly: ``num_layers / pp`` per pipeline rank;
* uneven first / last stage (``decoder_first_pipeline_num_layers``,
  ``decoder_last_pipeline_num_layers``; Megatron-LM's ``--decoder-first-pipeline-num-layers``):
  the first (last) rank holds the given number, the remaining layers are spread evenly over the
  middle ranks;
* embedding and loss as layers (``account_for_embedding_in_pipeline_split``,
  ``account_for_loss_in_pipeline_split``): the embedding and the loss each take one layer slot,
  ``(num_layers + 1 + 1) / pp`` slots per rank, and the first (last) virtual stage builds one
  layer fewer. Llama 3.1 405B: 126 layers + 2 = 128 slots over PP 8 x VP 8, two layers per virtual
  stage, one on the first and on the last.

With a virtual pipeline each rank's layers are divided evenly over its ``vp`` chunks. The two
uneven forms cannot be combined (as in Megatron-Core). A split that does not divide raises a
ConfigError that shows the arithmetic.

Or a layout (``pipeline_layout``, Megatron-Core's ``pipeline_model_parallel_layout``, as
``PipelineParallelLayerLayout`` reads it): one string per virtual stage, ``|`` between them, in the
order ``chunk * pp + rank``, of ``E`` (the embedding, first), ``t`` (a transformer layer), ``m`` (a
multi-token-prediction layer: in the last stage, before the loss) and ``L`` (the loss, last); ``(...)*n`` and ``x*n``
repeat, commas are cosmetic. DeepSeek-V3: ``Et|(tt|)*30mL`` over PP 8 x VP 4.
"""

from __future__ import annotations

import re

from typing import TYPE_CHECKING

from vtrain_plugin.core.errors import ConfigError

if TYPE_CHECKING:
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan


def rank_layers_error(plan: ParallelPlan, model: ModelSpec) -> str | None:
    """Why ``model``'s layers cannot be split over ``plan``'s pipeline ranks, or None."""
    return _per_rank(plan, model)[1]


def chunk_layers_error(plan: ParallelPlan, model: ModelSpec) -> str | None:
    """Why a rank's layers cannot be split evenly over its virtual chunks, or None (also when
    :func:`rank_layers_error` is not None: that error comes first)."""
    if _per_rank(plan, model)[1]:
        return None
    return _per_chunk(plan, model)[1]


def stage_layers(plan: ParallelPlan, model: ModelSpec) -> tuple[tuple[int, ...], ...]:
    """Transformer layers of ``[pipeline_rank][chunk]``; raises ConfigError for a split that does not divide."""
    layers, error = _per_chunk(plan, model)
    if error:
        raise ConfigError(error)
    return layers


def layout_stages(layout: str) -> list[str]:
    """The virtual stages of a layout string, repetitions unrolled (Megatron-Core's parse_str_to_list)."""
    text = layout.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def _layout_error(plan: ParallelPlan, model: ModelSpec) -> str | None:
    """Why ``plan.pipeline_layout`` does not lay out ``model`` over the plan's stages, or None."""
    layout, pp, vp = plan.pipeline_layout, plan.pipeline_parallel, plan.virtual_pipeline
    stages = layout_stages(layout)
    shown = f"parallel.pipeline_layout {layout!r}"
    flat = "".join(stages)
    unknown = sorted(set(flat) - set("EtmL"))
    if unknown:
        return f"{shown}: {unknown[0]!r} is none of E (embedding), t (layer), m (multi-token prediction), L (loss)"
    if len(stages) != pp * vp:
        return (f"{shown} has {len(stages)} stages, not pipeline_parallel ({pp}) x virtual_pipeline ({vp}) = "
                f"{pp * vp}")
    mtp = model.mtp_num_layers or 0
    if flat.count("m") != mtp:
        return f"{shown} places {flat.count('m')} multi-token prediction layers (m), not mtp_num_layers ({mtp})"
    if mtp and not stages[-1].rstrip("L").endswith("m" * mtp):
        return (f"{shown}: vtrain models the multi-token prediction layers (m) in the last stage, before the loss "
                f"(L), as megatron-core places them by default")
    if flat.count("E") != 1 or not flat.startswith("E") or flat.count("L") != 1 or not flat.endswith("L"):
        return f"{shown}: the embedding (E) must come first and the loss (L) last, once each"
    if flat.count("t") != model.num_layers:
        return f"{shown} places {flat.count('t')} layers (t), not num_layers ({model.num_layers})"
    return None


def _layout_layers(plan: ParallelPlan) -> list[list[int]]:
    """Layers of ``[pipeline_rank][chunk]`` of a checked layout."""
    stages, pp = layout_stages(plan.pipeline_layout), plan.pipeline_parallel
    return [[stages[chunk * pp + rank].count("t") for chunk in range(plan.virtual_pipeline)] for rank in range(pp)]


def _per_rank(plan: ParallelPlan, model: ModelSpec) -> tuple[tuple[int, ...], str | None]:
    if plan.pipeline_layout is not None:
        error = _layout_error(plan, model)
        return ((), error) if error else (tuple(sum(chunks) for chunks in _layout_layers(plan)), None)
    pp, total = plan.pipeline_parallel, model.num_layers
    first, last = plan.decoder_first_pipeline_num_layers, plan.decoder_last_pipeline_num_layers
    if first is None and last is None:
        slots = total + plan.account_for_embedding_in_pipeline_split + plan.account_for_loss_in_pipeline_split
        if slots % pp:
            if slots == total:
                return (), (f"pipeline_parallel_size ({pp}) must divide num_layers ({total}): {total} = {pp} x "
                            f"{total // pp} + {total % pp}{_remedy(plan, total)}{_then_virtual(plan)}")
            return (), f"{_slot_sum(plan, total)} = {slots} layer slots must be divisible by pipeline_parallel_size ({pp})"
        return (slots // pp,) * pp, None
    given = [(name, n) for name, n in (("decoder_first_pipeline_num_layers", first),
                                       ("decoder_last_pipeline_num_layers", last)) if n is not None]
    middle_stages = pp - len(given)
    middle_layers = total - sum(n for _, n in given)
    arithmetic = f"num_layers ({total}) - " + " - ".join(f"{name} ({n})" for name, n in given) + f" = {middle_layers}"
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        return (), f"{arithmetic} layers left for {middle_stages} middle pipeline stage(s)"
    if middle_stages and middle_layers % middle_stages:
        return (), f"{arithmetic} must be divisible by the {middle_stages} middle pipeline stages"
    per_rank = [middle_layers // middle_stages if middle_stages else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return tuple(per_rank), None


def _per_chunk(plan: ParallelPlan, model: ModelSpec) -> tuple[tuple[tuple[int, ...], ...], str | None]:
    per_rank, error = _per_rank(plan, model)
    if error:
        return (), error
    if plan.pipeline_layout is not None:
        return tuple(tuple(chunks) for chunks in _layout_layers(plan)), None
    pp, vp = plan.pipeline_parallel, plan.virtual_pipeline
    for rank, n in enumerate(per_rank):
        if n % vp:
            if not _uneven(plan):
                return (), (f"pipeline_parallel_size ({pp}) * virtual_pipeline ({vp}) = {pp * vp} must divide "
                            f"num_layers ({model.num_layers}): the {n} layers of each pipeline rank over its {vp} "
                            f"virtual stages{_remedy(plan, model.num_layers)}")
            return (), f"the {n} layer slots of pipeline rank {rank} must be divisible by virtual_pipeline ({vp})"
    layers = [[n // vp] * vp for n in per_rank]
    # Never below zero: every virtual stage has at least one slot, the first and the last two
    # when they are one (pp = vp = 1).
    if plan.account_for_embedding_in_pipeline_split:
        layers[0][0] -= 1
    if plan.account_for_loss_in_pipeline_split:
        layers[-1][-1] -= 1
    return tuple(tuple(chunks) for chunks in layers), None


def _uneven(plan: ParallelPlan) -> bool:
    return (plan.decoder_first_pipeline_num_layers is not None or plan.decoder_last_pipeline_num_layers is not None
            or plan.account_for_embedding_in_pipeline_split or plan.account_for_loss_in_pipeline_split)


# The settings that make the embedding and the loss take a layer slot each (ParallelPlan's names,
# Megatron-LM's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split).
_SLOT_SETTINGS = (("account_for_embedding_in_pipeline_split", 1), ("account_for_loss_in_pipeline_split", 1),
                  ("account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split", 2))


def _then_virtual(plan: ParallelPlan) -> str:
    vp = plan.virtual_pipeline
    return (f" (megatron-core splits the layers over the pipeline ranks before each rank's over its {vp} virtual "
            f"stages)") if vp > 1 else ""


def _remedy(plan: ParallelPlan, total: int) -> str:
    """How megatron-core could split ``total`` layers over an even plan's pipeline ranks and virtual
    stages (``num_layers % pp``, then each rank's ``% vp``): the fewest extra layer slots (the
    embedding, the loss, or both) that make them divide, with the arithmetic; else the uneven splits."""
    pp, vp = plan.pipeline_parallel, plan.virtual_pipeline
    for settings, extra in _SLOT_SETTINGS:
        slots = total + extra
        if slots % (pp * vp) == 0:
            stages = f"{pp} x {vp} x {slots // (pp * vp)}" if vp > 1 else f"{pp} x {slots // pp}"
            return f"; with {settings}: {total} + {extra} = {slots} = {stages} layer slots"
    return ("; neither the embedding nor the loss as a layer slot makes it divide: set "
            "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers or a pipeline_layout")


def _slot_sum(plan: ParallelPlan, total: int) -> str:
    terms = [f"num_layers ({total})"]
    if plan.account_for_embedding_in_pipeline_split:
        terms.append("1 (embedding)")
    if plan.account_for_loss_in_pipeline_split:
        terms.append("1 (loss)")
    return " + ".join(terms)
