"""Each command is declared once (its module's COMMANDS): the parser, the help order and the trace-cache
options all follow from that one declaration."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vtrain_plugin.cli import COMMAND_MODULES, build_parser, command_modules, commands
from vtrain_plugin.cli.commands import Command, register
from vtrain_plugin.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
HELP_ORDER = ["trace", "estimate", "profile", "profile-comm", "profile-export", "profile-import", "validate",
              "compare", "calibrate", "search", "size", "cluster-sim", "flags", "cache"]
TRACING = {"trace", "estimate", "profile", "validate", "compare", "calibrate", "search", "size", "cluster-sim"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


COMMANDS = commands()


def test_every_declared_command_is_parsed_in_help_order():
    assert [c.name for c in COMMANDS.values()] == HELP_ORDER
    assert [c.name for m in command_modules() for c in m.COMMANDS] == HELP_ORDER
    assert list(_subparsers(build_parser())) == HELP_ORDER


@pytest.mark.parametrize("name", HELP_ORDER)
def test_the_routing_table_names_the_module_that_declares_each_command(name):
    (module,) = command_modules([name])
    assert module.__name__ == f"vtrain_plugin.cli.{COMMAND_MODULES[name]}"
    assert name in [c.name for c in module.COMMANDS]
    assert list(_subparsers(build_parser([name]))) == [name]


def test_a_warm_estimate_imports_neither_the_planning_layer_nor_torch(tmp_path):
    # a fresh interpreter: what `vtrain estimate` loads, with its config error (nothing traced)
    code = ("import sys; from vtrain_plugin.cli import main; main(['estimate', 'missing.yaml']); "
            "print(sorted(m for m in sys.modules if m.startswith(('vtrain_plugin.planning', 'torch', 'megatron.', "
            "'pandas'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_estimate_help_loads_neither_numpy_nor_the_cost_model(tmp_path):
    # the estimate and its table are imported when the command runs, not to print its options
    code = ("import contextlib, io, sys; from vtrain_plugin.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(['estimate', '--help'])\n"
            "print(sorted(m for m in sys.modules if m in ('numpy', 'sqlite3', 'torch', 'vtrain_plugin.estimate') "
            "or m.startswith(('vtrain_plugin.cost', 'vtrain_plugin.sim', 'megatron.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", HELP_ORDER)
def test_tracing_commands_and_only_they_take_the_cache_options(name):
    parser = _subparsers(build_parser())[name]
    options = {o for a in parser._actions for o in a.option_strings}
    assert ("--cache-dir" in options and "--no-cache" in options) == (name in TRACING)
    assert COMMANDS.get(name).traces == (name in TRACING)
    assert parser.get_default("func") is COMMANDS.get(name).run


def test_a_name_declared_twice_is_refused():
    def nothing(_):
        return None

    one = Command(name="estimate", help="x", add_arguments=nothing, run=lambda args: 0)
    with pytest.raises(ConfigError, match="command 'estimate' is already registered"):
        register([one, one])


@pytest.mark.parametrize("name", HELP_ORDER)
def test_no_command_takes_an_abbreviated_option(name):
    # argparse would otherwise read `calibrate --gpu H100` as --gpus, and any prefix as the option it starts
    parser = _subparsers(build_parser())[name]
    assert parser.allow_abbrev is False and build_parser().allow_abbrev is False
    options = {o for a in parser._actions for o in a.option_strings}
    for option in options:
        prefix = option[:-1]
        if len(prefix) > 2 and prefix not in options and not any(o != option and o.startswith(prefix) for o in options):
            with pytest.raises(SystemExit):
                parser.parse_args([prefix, "x"])
            return
