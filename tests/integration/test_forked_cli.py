"""The tests' ``python -m`` runner (tests/support/zygote.py): a child forked from the zygote is a
separate process that sees the request's working directory, environment and argv, exits with its
own status, and gives the same output as a fresh interpreter; what a fork cannot give starts fresh.

Why: most integration tests run the CLI through it, so it must be as real as the subprocess it replaces."""

import json
import os

PROBE = """
import json, os, sys, threading
import vtrain_plugin
print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv[1:], "probe": os.environ.get("PROBE"),
                  "path0": sys.path[0], "main": __name__, "left_by_another": hasattr(vtrain_plugin, "_probe"),
                  "dont_write_bytecode": sys.flags.dont_write_bytecode, "threads": threading.active_count(),
                  "stdin": sys.stdin.read()}))
vtrain_plugin._probe = True
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _probe(python_m, folder, *args, input=None, **env):
    (folder / "probe_module.py").write_text(PROBE)
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    proc = python_m("probe_module", *args, cwd=folder, env=env, input=input)
    return proc, json.loads(proc.stdout)


def test_a_child_runs_the_module_where_and_as_asked_and_exits_with_its_status(python_m, tmp_path):
    first, seen = _probe(python_m, tmp_path, "3", "two words", PROBE="one")
    assert first.returncode == 3 and first.stderr == "to stderr\n"
    assert first.args[1:] == ["-m", "probe_module", "3", "two words"]
    assert seen["cwd"] == seen["path0"] == str(tmp_path) and seen["argv"] == ["3", "two words"]
    assert seen["probe"] == "one" and seen["main"] == "__main__" and seen["pid"] != os.getpid()
    assert not seen["left_by_another"] and seen["threads"] == 1 and seen["stdin"] == ""
    assert seen["dont_write_bytecode"] == bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    second, again = _probe(python_m, tmp_path, "0", input="a request\n")
    assert second.returncode == 0 and again["probe"] is None and not again["left_by_another"]
    assert again["stdin"] == "a request\n"
    assert again["pid"] != seen["pid"]


def test_a_start_up_variable_gets_a_fresh_interpreter(python_m, tmp_path):
    flipped = None if os.environ.get("PYTHONDONTWRITEBYTECODE") else "1"
    proc, seen = _probe(python_m, tmp_path, "0", PYTHONDONTWRITEBYTECODE=flipped)
    assert proc.returncode == 0 and seen["dont_write_bytecode"] == bool(flipped)


def test_forked_and_fresh_runs_of_the_cli_agree(python_m, tmp_path):
    for args in (["flags", "num-layers", "--format", "json"], ["estimat", "plan.yaml"], ["cache", "info"]):
        env = {**os.environ, "VTRAIN_CACHE_DIR": str(tmp_path / "cache")}
        forked = python_m("vtrain_plugin.cli", *args, env=env)
        fresh = python_m("vtrain_plugin.cli", *args, env=env, fresh=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.stdout.startswith(f"trace cache {tmp_path / 'cache' / 'traces'}: ")
