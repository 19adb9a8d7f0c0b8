"""Each command is declared once (its module's COMMANDS): the parser, the help order and the trace-cache
options all follow from that one declaration."""

import argparse

import pytest

from vtrain_plugin.cli import COMMANDS, MODULES, build_parser
from vtrain_plugin.cli.commands import Command, register
from vtrain_plugin.core.errors import ConfigError

HELP_ORDER = ["trace", "estimate", "profile", "profile-comm", "profile-export", "profile-import", "validate",
              "compare", "calibrate", "search", "size", "cluster-sim", "flags", "cache"]
TRACING = {"trace", "estimate", "profile", "validate", "compare", "calibrate", "search", "size", "cluster-sim"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_declared_command_is_parsed_in_help_order():
    assert [c.name for c in COMMANDS.values()] == HELP_ORDER
    assert [c.name for m in MODULES for c in m.COMMANDS] == HELP_ORDER
    assert list(_subparsers(build_parser())) == HELP_ORDER


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
