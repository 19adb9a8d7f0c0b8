"""``vtrain estimate CONFIG...``: the predicted iteration of each plan, from measured profiles where
the database has them, and with ``--tokens`` the time and cost of the whole run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.cli.common import EXIT_USER_ERROR, db_option, positive_int, profile_db, reliability_options, with_reliability
from vtrain_plugin.cli.inputs import INPUT_HELP, add_input_options, run_inputs
from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError, VTrainError
from vtrain_plugin.specs import plan_file
from vtrain_plugin.specs.run import RunConfig

if TYPE_CHECKING:
    from vtrain_plugin.estimate import Estimate


FORMATS = ("table", "json", "jsonl", "csv")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="*", help=INPUT_HELP)
    add_input_options(p)
    p.add_argument("--tokens", metavar="N", help="tokens of the whole training run (e.g. 270e9), overriding "
                                                  "training.total_tokens: adds iterations, days, GPU-hours and cost, "
                                                  "failure-free and expected with failures (--failures)")
    reliability_options(p)
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table (default); json: one object, an array of them for several configs; jsonl: one "
                        "line per config, errors inline; csv: one row per config (pandas columns of to_row)")
    db_option(p, can_disable=True)
    p.add_argument("--explain", type=int, nargs="?", const=10, default=0, metavar="N",
                   help="list the N largest unmeasured kernels (default 10)")
    p.add_argument("--timeline", metavar="FILE", help="write a Chrome trace / Perfetto timeline")
    p.add_argument("--timeline-max-stages", type=positive_int, metavar="N",
                   help="write at most N pipeline stages (first and last always kept)")
    p.add_argument("--timeline-max-microbatches", type=positive_int, metavar="N",
                   help="write at most N micro-batches per stage")


def run(args: argparse.Namespace) -> int:
    """Estimate every input in turn; a bad input is reported (inline with jsonl and json, on stderr
    otherwise) and the others still run. Exit 2 when any failed."""
    # here, not at import: the estimate and its table load numpy and the cost model, which neither
    # `vtrain --help` nor `vtrain estimate --help` needs
    from vtrain_plugin.cli.render import estimate_table
    from vtrain_plugin.estimate import estimate, estimates_frame

    tokens = None if args.tokens is None else _total_tokens(args.tokens)
    inputs = run_inputs(args)
    failed = 0
    documents: list[dict] = []  # --format json: printed together, as one array for several configs
    rows: list[tuple[str, RunConfig, Estimate]] = []  # --format csv
    for index, (path, load) in enumerate(inputs):
        try:
            run_config = load()
            if tokens is not None:
                run_config = replace(run_config, training=replace(run_config.training, total_tokens=tokens))
            run_config = replace(run_config, training=replace(
                run_config.training, reliability=with_reliability(args, run_config.training.reliability)))
            result = estimate(run_config, profile_db=profile_db(args), timeline=bool(args.timeline),
                                            explain=args.explain or 0)
            if args.timeline:
                result.write_timeline(_timeline_path(args.timeline, index, len(inputs)),
                                      max_ranks=args.timeline_max_stages,
                                      max_microbatches=args.timeline_max_microbatches)
        except VTrainError as exc:
            failed += 1
            if args.format == "jsonl":
                _write(_json({"config": path, "error": str(exc)}))
            else:
                print(f"vtrain: error: {exc}", file=sys.stderr)
                if args.format == "json":
                    documents.append({"config": path, "error": str(exc)})
            continue
        if args.format == "jsonl":
            _write(_json({"config": path, "plan": plan_document(run_config), **result.to_dict()}))
        elif args.format == "json":
            documents.append({"config": path, "plan": plan_document(run_config), **result.to_dict(), "largest_unmeasured": [
                {"op": k.op, "input_shapes": k.input_shapes, "dtypes": k.dtypes, "phase": k.phase,
                 "module": k.module, "time_ms": k.time_ms} for k in result.largest_unmeasured]})
        elif args.format == "csv":
            rows.append((path, run_config, result))
        else:
            _write(estimate_table(run_config, result))
    if args.format == "json" and documents:
        _write(_json(documents[0] if len(inputs) == 1 else documents, indent=1))
    elif args.format == "csv" and rows:
        import pandas as pd  # here: loading it takes a third of a second, and other formats need none of it

        frame = estimates_frame((result for _, _, result in rows))
        plans = pd.DataFrame([_flat(plan_document(run_config)) for _, run_config, _ in rows], index=frame.index)
        config = pd.DataFrame({"config": [path for path, _, _ in rows]}, index=frame.index)
        frame = pd.concat([config, frame, plans[[c for c in plans.columns if c not in frame.columns]]], axis=1)
        sys.stdout.write(frame.to_csv(index=False))
    return EXIT_USER_ERROR if failed else 0


def plan_document(run: RunConfig) -> dict[str, dict[str, Any]]:
    """Every field of the plan an estimate was made of, as read, as a plan file (it estimates the
    same): model, parallel, training, cluster and reliability sections."""
    return plan_file.plan_document(run.model, run.parallel, run.training, run.cluster.to_dict())


def _flat(document: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``section.field`` columns (``training.reliability.failures``)."""
    flat: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _json(document: object, *, indent: int | None = None) -> str:
    """Standard JSON: a non-finite number (which no estimate should hold) is an error, not
    ``Infinity``."""
    return json.dumps(document, indent=indent, allow_nan=False)


def _write(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _total_tokens(text: str) -> float:
    """``--tokens``, checked before any config is read: a bad value is one error, not one per config."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--tokens must be a number of tokens such as 270e9, got {text!r}") from None
    return v.positive_finite_number("--tokens", value)


def _timeline_path(path: str, index: int, total: int) -> Path:
    """One timeline per config: ``t.json`` for one config, ``t.0.json``, ``t.1.json``... for several."""
    p = Path(path)
    return p if total == 1 else p.with_name(f"{p.stem}.{index}{p.suffix}")


COMMANDS = (Command(name="estimate", add_arguments=add_arguments, run=run, traces=True,
                    help="predict the iteration time of one or more plans"),)
