"""``vtrain flags [FLAG ...]``: what vtrain does with each Megatron-LM flag, and why.

The table behind the Megatron-LM reader (:mod:`vtrain_plugin.specs.megatron.flags`), so a user can see
before launching whether a flag is modelled, accepted as changing nothing (and for which reason),
named as a second-order effect, or refused.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron import fusion_flags, model
from vtrain_plugin.specs.megatron.fusion_flags import no_effect_notes
from vtrain_plugin.specs.megatron.flags import (
    ALIASES, NO_EFFECT_REASONS, TABLE, Effect, Flag, flags_by_release, releases)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("flags", nargs="*", metavar="FLAG", help="flags to show, without their leading -- (default: all)")
    p.add_argument("--release", metavar="R", help=f"only the flags of this Megatron-LM release ({releases()[0]} .. "
                                                  f"{releases()[-1]})")
    p.add_argument("--effect", choices=[e.value for e in Effect], help="only flags with this effect")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")


def _selected(args: argparse.Namespace) -> list[Flag]:
    chosen = list(TABLE.values())
    if args.flags:
        names = [name if name.startswith("--") else f"--{name}" for name in args.flags]
        unknown = [name for name in names if name not in TABLE]
        if unknown:
            raise ConfigError(f"flags: {unknown[0]} is in no Megatron-LM release from {releases()[0]} to "
                              f"{releases()[-1]}")
        chosen = [TABLE[name] for name in names]
    if args.release is not None:
        if args.release not in flags_by_release():
            raise ConfigError(f"--release must be one of {', '.join(releases())}; got {args.release!r}")
        have = flags_by_release()[args.release]
        chosen = [flag for flag in chosen if flag.name in have]
    if args.effect is not None:
        chosen = [flag for flag in chosen if flag.effect.value == args.effect]
    return chosen


def _row(flag: Flag) -> dict[str, str]:
    return {"flag": flag.name, "effect": flag.effect.value, "reason": flag.reason,
            "releases": f"{flag.first_release}..{flag.last_release}", "alias_of": ALIASES.get(flag.name, "")}


def _why(flag: Flag) -> str:
    if flag.effect is Effect.MODELLED:
        notes = [table[flag.name] for table in (fusion_flags.FLAG_NOTES, model.FLAG_NOTES) if flag.name in table]
        return "; ".join((f"read by vtrain_plugin/specs/megatron/{flag.reason}.py", *no_effect_notes(flag.name),
                          *notes))
    if flag.effect is Effect.NO_EFFECT:
        return f"{flag.reason}: {NO_EFFECT_REASONS[flag.reason]}"
    if flag.effect is Effect.RETIRED:
        return f"Megatron-LM refuses it; use {flag.reason}"
    return flag.reason


def run(args: argparse.Namespace) -> int:
    rows = [_row(flag) for flag in _selected(args)]
    if args.format == "json":
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    elif args.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(_row(next(iter(TABLE.values())))), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        width = max((len(r["flag"]) for r in rows), default=4)
        lines = [f"{'flag':{width}s}  {'effect':12s}  reason"]
        lines += [f"{flag.name:{width}s}  {flag.effect.value:12s}  {_why(flag)}" for flag in _selected(args)]
        counts = {e.value: sum(r["effect"] == e.value for r in rows) for e in Effect}
        lines.append(f"{len(rows)} flags: " + ", ".join(f"{n} {e}" for e, n in counts.items() if n))
        sys.stdout.write("\n".join(lines) + "\n")
    return 0


COMMANDS = (Command(name="flags", add_arguments=add_arguments, run=run,
                    help="what vtrain does with each Megatron-LM flag (modelled, no effect, refused) and why"),)
