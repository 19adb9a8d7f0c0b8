"""The table of Megatron-LM's flags: every flag of every release is read, and no flag that configures
the model, the parallel plan, the optimizer or DDP is accepted as changing nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.args import FIELDS, megatron_plan, parse_flags
from vtrain_plugin.specs.megatron.flags import (
    ALIASES, NO_EFFECT_REASONS, OUTSIDE_STEP_REASONS, TABLE, Arity, Effect, flags_by_release, releases)
from vtrain_plugin.specs.megatron.launch_script import read_command_line

READERS = Path(__file__).resolve().parents[4] / "vtrain_plugin" / "specs" / "megatron"
# The modules that read flags: every module of the package but the table, the launch-script reader,
# the value parsers and the Megatron-Bridge reader (which turns fields into flags for the others).
READER_MODULES = tuple(sorted(p.stem for p in READERS.glob("*.py") if p.stem not in (
    "__init__", "bridge", "flags", "flag_values", "launch_script", "shell_expand", "shell_test", "shell_words")))
# Configuration dataclasses of megatron-core: a flag that sets one of their fields configures what
# runs, so "changes nothing" is never its reason.
CONFIG_FIELDS = frozenset(f.name for config in (TransformerConfig, ModelParallelConfig, OptimizerConfig,
                                                DistributedDataParallelConfig) for f in dataclasses.fields(config))
BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --vocab-size 128"


def _literals(module: str) -> set[str]:
    return set(re.findall(r'"(--[A-Za-z0-9_-]+)', (READERS / f"{module}.py").read_text()))


def test_the_table_holds_every_flag_of_every_scanned_release():
    assert len(TABLE) == 976 and releases()[0] == "core_r0.8.0" and releases()[-1] == "main"
    for release, flags in flags_by_release().items():
        assert flags <= set(TABLE), release
    assert len(flags_by_release()["core_v0.16.1"]) == 700  # Megatron-LM's own count (data/README.md)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(flags_by_release())), st.data())
def test_every_flag_of_a_release_is_recognised(release, data):
    """Any flag of the release parses (with a value where it takes one) and is never 'unknown'."""
    flag = data.draw(st.sampled_from(sorted(flags_by_release()[release])))
    words = [flag] if TABLE[flag].arity is Arity.SWITCH else [flag, "1"]
    try:
        parse_flags(words)
    except ConfigError as exc:
        assert "unknown argument" not in str(exc)


def test_no_configuration_field_is_accepted_as_changing_nothing():
    wrong = sorted(f.name for f in TABLE.values() if f.effect is Effect.NO_EFFECT and (
        f.dest in CONFIG_FIELDS or f.source_file.endswith(("transformer_config.py", "model_parallel_config.py"))))
    assert wrong == []


def test_each_accepted_flag_has_a_reason_from_the_fixed_list():
    for flag in TABLE.values():
        if flag.effect is Effect.NO_EFFECT:
            assert flag.reason in NO_EFFECT_REASONS, flag.name
        elif flag.effect is Effect.OUTSIDE_STEP:
            assert flag.reason in OUTSIDE_STEP_REASONS, flag.name
        else:
            assert flag.reason, flag.name


def test_every_flag_a_reader_names_is_modelled_or_refused():
    """A flag the readers look at cannot be filed as free; a modelled flag is read where the table says."""
    named = {literal: module for module in READER_MODULES for literal in _literals(module)}
    for name, module in named.items():
        if name in TABLE:
            assert TABLE[name].effect in (Effect.MODELLED, Effect.REFUSED, Effect.SECOND_ORDER, Effect.OTHER_MODEL,
                                          Effect.RETIRED), name
    for flag in TABLE.values():
        if flag.effect is Effect.MODELLED:
            canonical = ALIASES.get(flag.name, flag.name)
            assert flag.reason in READER_MODULES and canonical in _literals(flag.reason), flag.name


def test_the_flags_the_mapping_refuses_are_refused_in_the_table():
    for row in FIELDS:
        assert row.flag in TABLE, row.flag
        if row.field is None and row.what:  # a refusal; rows without one are checks of flags read elsewhere
            assert TABLE[row.flag].effect is Effect.REFUSED, row.flag


def test_aliases_share_their_effect():
    for alias, canonical in ALIASES.items():
        assert TABLE[alias].dest == TABLE[canonical].dest and TABLE[alias].effect is TABLE[canonical].effect


def plan(flags: str):
    return megatron_plan(read_command_line(f"{BASE} {flags}"), gpus=1)


def test_a_refused_flag_at_megatrons_default_is_accepted():
    assert plan("--moe-hybridep-num-sms-preprocessing 108").model.num_layers == 2  # the default value
    with pytest.raises(ConfigError, match="^--moe-hybridep-num-sms-preprocessing 100: tunings of the flex dispatcher"):
        plan("--moe-hybridep-num-sms-preprocessing 100")
    with pytest.raises(ConfigError, match="^--enable-mhc-connections: manifold hyper-connections"):
        plan("--enable-mhc-connections")


def test_flags_of_other_releases_and_their_aliases_are_read():
    assert plan("--dist-ckpt-optim-fully-reshardable --verify-integrity --async-ckpt-use-cpu-shm"
                " --dist-ckpt-save-pre-mcore-014").model.num_layers == 2  # checkpoint format: no effect
    assert parse_flags(["--local-rank", "3"]) == {"--local_rank": "3"}
    assert parse_flags(["--no-tp-comm-overlap-ag"]) == {"--disable-tp-comm-overlap-ag": True}


@pytest.mark.parametrize("flag, replacement", [("--batch-size 4", "--micro-batch-size"),
                                               ("--checkpoint-activations", "--recompute-activations")])
def test_retired_flags_name_their_replacement(flag, replacement):
    with pytest.raises(ConfigError, match=f"is retired in Megatron-LM; use {replacement}$"):
        plan(flag)
