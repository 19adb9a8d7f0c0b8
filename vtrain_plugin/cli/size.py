"""``vtrain size``: the largest model of a family that trains compute-optimally within a budget."""

from __future__ import annotations

import argparse
import json
import sys

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.cli.common import db_option, emit, profile_db, reliability_options, with_reliability
from vtrain_plugin.cli.render import sizing_table
from vtrain_plugin.cli.search import _number, space_from_args
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.cli.inputs import add_hardware_options, hardware
from vtrain_plugin.planning.model_family import (CHINCHILLA_TOKENS_PER_PARAMETER, HEAD_DIM, HIDDEN_STEP, LADDER_DEFAULTS,
                                                 MHA)
from vtrain_plugin.planning.plot import plot_sizing
from vtrain_plugin.planning.sizing import DEFAULT_BATCH_TOKENS, DEFAULT_NAIVE_MFU, size_model
from vtrain_plugin.planning.space import AXES, GpuBudget
from vtrain_plugin.specs.model import Family
from vtrain_plugin.specs.reliability import ReliabilitySpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="gpt", help=f"model family: {', '.join(f.value for f in Family)} (default gpt)")
    add_hardware_options(p, required=True)
    p.add_argument("--gpus", required=True, metavar="BUDGET", help="GPUs a plan may use: a count (exactly that many: 3360), a range LOW:HIGH "
                                                               "(1:3360 for at most 3360) or a list (2240,2800,3360)")
    p.add_argument("--days", metavar="D", help="wall-clock budget in days")
    p.add_argument("--budget-usd", metavar="USD", help="dollar budget (needs a price on the cluster)")
    p.add_argument("--tokens-per-parameter", default=str(CHINCHILLA_TOKENS_PER_PARAMETER), metavar="R",
                   help=f"training tokens per parameter (default {CHINCHILLA_TOKENS_PER_PARAMETER:g}, Chinchilla)")
    p.add_argument("--batch-tokens", default=str(DEFAULT_BATCH_TOKENS), metavar="N",
                   help=f"tokens per iteration (default {DEFAULT_BATCH_TOKENS:,})")
    p.add_argument("--mfu", default=str(DEFAULT_NAIVE_MFU), metavar="F",
                   help=f"MFU of the naive fixed-MFU answer (default {DEFAULT_NAIVE_MFU:g})")
    p.add_argument("--min-params", default="1e9", metavar="N", help="smallest shape (default 1e9)")
    p.add_argument("--max-params", default="2e12", metavar="N", help="largest shape (default 2e12)")
    p.add_argument("--hidden-step", default=str(HIDDEN_STEP), metavar="N",
                   help=f"hidden-size step of the ladder (default {HIDDEN_STEP})")
    gpt, llama = LADDER_DEFAULTS[Family.GPT], LADDER_DEFAULTS[Family.LLAMA]
    p.add_argument("--seq-length", metavar="N", help=f"sequence length of every shape (default: gpt {gpt.seq_length}, "
                                                    f"llama {llama.seq_length})")
    p.add_argument("--vocab-size", metavar="N", help=f"vocabulary of every shape (default: gpt {gpt.vocab_size}, "
                                                    f"llama {llama.vocab_size})")
    p.add_argument("--query-groups", metavar="N|mha",
                   help=f"key-value groups of every shape (GQA; must divide each shape's hidden / 128 heads), or mha "
                        f"for multi-head attention (default: gpt {_groups(gpt.num_query_groups)}, "
                        f"llama {_groups(llama.num_query_groups)})")
    p.add_argument("--experts", metavar="N", help="experts per MoE layer, every layer (default: none, dense)")
    p.add_argument("--top-k", metavar="K", help="experts per token, with --experts (default 2)")
    for axis in AXES:
        p.add_argument(f"--{axis.flag.replace('_', '-')}", dest=axis.name, metavar="LIST",
                       help=f"{axis.label} of each shape's search; comma-separated (default: {axis.default_label})")
    p.add_argument("--max-tp", metavar="N", help="largest tensor-parallel size tried (default: GPUs per node, or the largest --tp given)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.add_argument("--plot", metavar="FILE.png", help="draw parameters against days to train, with the budget")
    p.add_argument("--workers", metavar="N", help="worker processes per search (default: CPU count)")
    reliability_options(p)
    db_option(p, can_disable=True)


def _groups(groups: int) -> str:
    return "mha" if groups == MHA else str(groups)


def _query_groups(text: str | None) -> int | None:
    if text is None:
        return None
    if text.strip().lower() == "mha":
        return MHA
    try:
        return _number("--query-groups", text, int)
    except ConfigError:
        raise ConfigError(f"--query-groups must be a positive integer or mha, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    if args.days is None and args.budget_usd is None:
        raise ConfigError("give a budget: --days and/or --budget-usd")
    try:
        family = Family(args.family)
    except ValueError:
        raise ConfigError(f"--family must be one of {', '.join(f.value for f in Family)}; got {args.family!r}") from None
    cluster = hardware(args).chosen_cluster()
    if args.top_k is not None and args.experts is None:
        raise ConfigError("--top-k needs --experts (a mixture-of-experts ladder)")
    groups = _query_groups(args.query_groups)
    groups = LADDER_DEFAULTS[family].num_query_groups if groups is None else groups
    step = _number("--hidden-step", args.hidden_step, int)
    if groups != MHA and step % (HEAD_DIM * groups):
        raise ConfigError(f"--query-groups {groups} must divide every shape's heads (hidden / {HEAD_DIM}): "
                          f"--hidden-step must then be a multiple of {HEAD_DIM} x {groups} = {HEAD_DIM * groups}, "
                          f"got {step}")
    if args.top_k is not None and _number("--top-k", args.top_k, int) > _number("--experts", args.experts, int):
        raise ConfigError(f"--top-k ({args.top_k}) must not exceed --experts ({args.experts})")
    mfu = _number("--mfu", args.mfu, float)
    if mfu > 1:
        raise ConfigError(f"--mfu must lie in (0, 1], got {args.mfu!r}")
    result = size_model(
        family, cluster=cluster, gpus=GpuBudget.parse(args.gpus, where="--gpus"),
        days=_number("--days", args.days, float) if args.days is not None else None,
        budget_usd=_number("--budget-usd", args.budget_usd, float) if args.budget_usd is not None else None,
        tokens_per_parameter=_number("--tokens-per-parameter", args.tokens_per_parameter, float),
        batch_tokens=_number("--batch-tokens", args.batch_tokens, int), naive_mfu=mfu,
        min_params=_number("--min-params", args.min_params, float),
        max_params=_number("--max-params", args.max_params, float),
        hidden_step=_number("--hidden-step", args.hidden_step, int), space=space_from_args(args),
        workers=_number("--workers", args.workers, int) if args.workers is not None else None,
        progress=sys.stderr.isatty(), reliability=with_reliability(args, ReliabilitySpec()),
        profile_db=profile_db(args),
        seq_length=_number("--seq-length", args.seq_length, int) if args.seq_length is not None else None,
        vocab_size=_number("--vocab-size", args.vocab_size, int) if args.vocab_size is not None else None,
        num_query_groups=groups,
        num_experts=_number("--experts", args.experts, int) if args.experts is not None else None,
        moe_router_topk=_number("--top-k", args.top_k, int) if args.top_k is not None else None)
    if args.format == "json":
        emit(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n", args.output)
    else:
        emit(sizing_table(result) + "\n", args.output)
    if args.plot:
        plot_sizing(result, args.plot)
    return 0


COMMANDS = (Command(name="size", add_arguments=add_arguments, run=run, traces=True,
                    help="the largest model that trains compute-optimally within days or dollars"),)
