"""``vtrain flags``: the flag table from the command line."""

from __future__ import annotations

import json
import subprocess
import sys


def vtrain(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vtrain_plugin.cli", "flags", *words], capture_output=True, text=True)


def test_named_flags_show_their_effect_and_reason():
    out = vtrain("num-layers", "dist-ckpt-optim-fully-reshardable", "batch-size")
    assert out.returncode == 0
    assert out.stdout.splitlines() == [
        "flag                                 effect        reason",
        "--num-layers                         modelled      read by vtrain_plugin/specs/megatron/args.py",
        "--dist-ckpt-optim-fully-reshardable  no_effect     checkpoint: checkpoint format, location, loading or "
        "retention (checkpoint time is priced from --save-interval)",
        "--batch-size                         retired       Megatron-LM refuses it; use --micro-batch-size",
        "3 flags: 1 modelled, 1 no_effect, 1 retired"]


def test_a_release_lists_its_own_flags():
    rows = json.loads(vtrain("--release", "core_v0.16.1", "--format", "json").stdout)
    assert len(rows) == 700 and {"flag", "effect", "reason", "releases", "alias_of"} == set(rows[0])


def test_bad_input_is_one_line_and_exit_2():
    out = vtrain("no-such-flag")
    assert out.returncode == 2 and out.stderr == (
        "vtrain: error: flags: --no-such-flag is in no Megatron-LM release from core_r0.8.0 to main\n")
