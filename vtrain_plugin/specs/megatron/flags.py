"""Every command-line flag of Megatron-LM's ``pretrain_gpt.py`` and ``pretrain_mamba.py``, and what
vtrain does with it.

The flags are data: ``data/flags_by_release.csv`` lists the 976 flags of every release from
core_r0.8.0 to main (spelling, dest, arity, default, the releases that have them), extracted from
Megatron-LM's own sources (``data/README.md``). ``data/flag_effects.csv`` gives each flag one
:class:`Effect` and its reason. A flag in no release is refused as unknown, naming the nearest
spelling; every other flag is read the same way whichever release the user runs.

Why a table: a command line from any release must be read without editing, and a flag must never be
accepted as free when it changes what a GPU does. The table makes each decision visible and tested
(``tests/unit/specs/megatron/test_flag_table.py``): the no-effect class cannot hold a field of
TransformerConfig, the optimizer or DDP, and every flag a reader module names is modelled or refused.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from enum import Enum, StrEnum
from functools import lru_cache
from importlib import resources
from typing import Any


class Arity(Enum):
    SWITCH = 0  # store_true / store_false / one side of a BooleanOptionalAction
    ONE = 1  # one value
    LIST = 2  # nargs '*', '+' or a count


class Effect(StrEnum):
    """What a flag does to the time or memory of a training iteration, and so what vtrain does with it."""

    MODELLED = "modelled"  # read into a spec field; the reason names the reader module
    VALUE_ONLY = "value_only"  # a number inside the same kernels (a rate, an epsilon, a scale): accepted
    OUTSIDE_STEP = "outside_step"  # read only outside the training iteration (start-up, inference, evaluation)
    IGNORED = "ignored"  # parsed and ignored by Megatron-LM, or set by it from other flags
    NO_EFFECT = "no_effect"  # changes neither time nor memory; the reason is one of NO_EFFECT_REASONS
    SECOND_ORDER = "second_order"  # a few per cent of a kernel class at most: accepted and named in one warning
    REFUSED = "refused"  # changes time or memory and is not priced: refused unless at Megatron-LM's default
    OTHER_MODEL = "other_model"  # only another model family (BERT, T5, RETRO) takes it: refused
    RETIRED = "retired"  # Megatron-LM itself refuses it; the reason names the flag that replaced it


# The only reasons a flag may change nothing: what it touches is outside the GPUs' work of a step.
NO_EFFECT_REASONS = {
    "logging": "what is logged and how often, with no work added per step",
    "checkpoint": "checkpoint format, location, loading or retention (checkpoint time is priced from --save-interval)",
    "data": "data, tokenizer and dataset files and their construction",
    "run_length": "run length, evaluation schedule and exit conditions (vtrain predicts one training iteration)",
    "seed": "a random seed",
    "inference": "an inference-only setting",
    "other_entry_point": "read only by another Megatron-LM entry point (vision, retrieval, RL)",
    "process_setup": "process start-up, timeouts, debugging and fault-tolerance plumbing",
    "profiling": "a profiler or debugging window outside the steady iteration",
}
OUTSIDE_STEP_REASONS = ("startup", "inference", "evaluation")


@dataclass(frozen=True, slots=True)
class Flag:
    """One Megatron-LM flag: its spelling, what argparse stores, when it exists and what vtrain does."""

    name: str  # with its leading --
    dest: str  # Megatron-LM's args attribute (a TransformerConfig field name for generated flags)
    action: str  # argparse's action as written ('' = store)
    arity: Arity
    default: str  # as written in Megatron-LM's source ('' = argparse's implicit default)
    first_release: str
    last_release: str
    source_file: str  # the Megatron-LM file that defines it
    help: str  # Megatron-LM's help text (its first 200 characters)
    effect: Effect
    reason: str

    def at_default(self, value: Any) -> bool:
        """Whether ``value`` (as parsed: True for a switch, a string, or a list of strings) is
        Megatron-LM's default, so that the flag changes nothing."""
        if self.arity is Arity.SWITCH:
            return False  # giving a switch always changes it
        default = self.default.strip("'\"")
        if isinstance(value, list):
            value = " ".join(value)
        if default in ("", "None"):
            return False
        if value == default:
            return True
        try:
            return float(value) == float(default)
        except ValueError:
            return False


def _arity(row: dict[str, str]) -> Arity:
    if row["action"] in ("store_true", "store_false", "argparse.BooleanOptionalAction"):
        return Arity.SWITCH
    return Arity.LIST if row["nargs"] else Arity.ONE


def _read_csv(name: str) -> list[dict[str, str]]:
    with resources.files(__package__).joinpath("data", name).open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


@lru_cache(maxsize=1)
def flag_table() -> dict[str, Flag]:
    """Every flag of every release, by spelling."""
    effects = {row["flag"]: row for row in _read_csv("flag_effects.csv")}
    table: dict[str, Flag] = {}
    for row in _read_csv("flags_by_release.csv"):
        name = row["flag"]
        if not name.startswith("--"):  # a dataclass field Megatron-LM names without dashes: not a flag
            continue
        effect = effects[name]
        table[name] = Flag(name=name, dest=row["dest"], action=row["action"], arity=_arity(row), default=row["default"],
                           first_release=row["first_release"], last_release=row["last_release"],
                           source_file=row["source_file"], help=row["help"], effect=Effect(effect["effect"]), reason=effect["reason"])
    return table


@lru_cache(maxsize=1)
def releases() -> tuple[str, ...]:
    """The Megatron-LM revisions scanned, oldest first."""
    with resources.files(__package__).joinpath("data", "flags_presence.csv").open(encoding="utf-8") as f:
        return tuple(next(csv.reader(f))[1:])


@lru_cache(maxsize=1)
def flags_by_release() -> dict[str, frozenset[str]]:
    """The flags each scanned revision has."""
    names = releases()
    have: dict[str, set[str]] = {name: set() for name in names}
    for row in _read_csv("flags_presence.csv"):
        for name in names:
            if row[name] == "1":
                have[name].add(row["flag"])
    return {name: frozenset(flags) for name, flags in have.items()}


def _aliases(table: dict[str, Flag]) -> dict[str, str]:
    """Spellings of one setting (``--no-X`` and ``--disable-X``; ``--local_rank``): each to the oldest,
    the one vtrain reads. Only flags with the same dest and the same action are aliases: ``--X`` / ``--no-X`` pairs of a
    BooleanOptionalAction are opposites."""
    groups: dict[tuple[str, str], list[str]] = {}
    for flag in table.values():
        if flag.action != "argparse.BooleanOptionalAction":
            groups.setdefault((flag.dest, flag.action), []).append(flag.name)
    order = {release: i for i, release in enumerate(releases())}
    aliases: dict[str, str] = {}
    for names in groups.values():
        if len(names) > 1:  # the oldest spelling, which readers of every release know
            canonical = min(names, key=lambda n: (order[table[n].first_release], n))
            aliases.update({name: canonical for name in names if name != canonical})
    return aliases


TABLE = flag_table()
ALIASES = _aliases(TABLE)
MEGATRON_FLAGS: dict[str, Arity] = {name: flag.arity for name, flag in TABLE.items()}
PERFORMANCE_FLAGS = frozenset(name for name, flag in TABLE.items() if flag.effect is Effect.SECOND_ORDER)
UNSUPPORTED_FLAGS = {name: flag.reason for name, flag in TABLE.items() if flag.effect is Effect.OTHER_MODEL}
RETIRED_FLAGS = {name: flag.reason for name, flag in TABLE.items() if flag.effect is Effect.RETIRED}

# Megatron-LM's entry points other than pretrain_gpt.py, by the model family they train.
UNSUPPORTED_SCRIPTS = {"pretrain_bert": "BERT models", "pretrain_t5": "encoder-decoder (T5) models",
                       "pretrain_vlm": "vision-language models",
                       "pretrain_retro": "retrieval (RETRO) models", "pretrain_ict": "retrieval (ICT) models",
                       "pretrain_vision": "vision models", "train_rl": "reinforcement-learning (GRPO) runs"}
