"""Every command that takes ``--gpus`` or ``--format`` rejects a bad value in one line naming the
option and the rule, exit code 2 (argparse's usage dump followed by the error is not one line)."""

import pytest

from vtrain_plugin.cli import build_parser

PLAN = "examples/plans/gpt_tiny_cpu.yaml"
# The least each command needs besides the option under test to get as far as checking it.
REQUIRED = {
    "trace": (PLAN,), "estimate": (PLAN,), "validate": (PLAN,), "compare": (PLAN, "run.log"),
    "calibrate": ("--from-runs", "run.log", "--plan", PLAN), "search": (PLAN,),
    "size": ("--gpu", "A100", "--days", "3"), "cluster-sim": ("--gpu", "A100", "--nodes", "2"), "flags": (),
}


def _commands_with(option: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(name for name, p in sub.choices.items() if any(option in a.option_strings for a in p._actions))


def test_every_command_with_the_options_is_covered():
    assert set(_commands_with("--gpus")) | set(_commands_with("--format")) == set(REQUIRED)


@pytest.mark.parametrize("command", _commands_with("--format"))
def test_bad_format_is_one_line(run_cli, command):
    proc = run_cli(command, *REQUIRED[command], "--format", "yml")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"vtrain {command}: error: argument --format: invalid choice: 'yml' (choose from 'table'")


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("command", _commands_with("--gpus"))
def test_non_positive_gpus_is_one_line(run_cli, command, value):
    proc = run_cli(command, *REQUIRED[command], "--gpus", value)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line in (f"vtrain {command}: error: argument --gpus: must be a positive integer, got {value} "
                    f"(see vtrain {command} --help)",
                    f"vtrain: error: --gpus must be positive, got {value}")


def test_unknown_command_is_one_line(run_cli):
    proc = run_cli("estimat", PLAN)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("vtrain: error: argument COMMAND: invalid choice: 'estimat'")
