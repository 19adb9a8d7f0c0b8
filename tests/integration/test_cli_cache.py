"""The trace cache through the real CLI in subprocesses: warm runs give the same bytes and load neither
megatron-core nor torch; ``--no-cache``, ``--cache-dir``, ``vtrain cache``; a search starts warm."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

from vtrain_plugin.capture import disk_cache

REPO = Path(__file__).resolve().parents[2]

PLAN = "examples/plans/gpt_tiny_cpu.yaml"
SEARCH_MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                "vocab_size": 1024}
SEARCH_ARGS = ["--gpus", "2,4", "--tp", "1,2", "--pp", "1,2", "--micro-batch", "1", "--sp", "off",
               "--recompute", "none", "--format", "csv"]


def _entries(folder):
    return sorted((folder / "traces").glob(f"*{disk_cache.SUFFIX}")) if (folder / "traces").exists() else []


def _imported_modules(cache, tmp_path, *args):
    """Run ``python -X importtime -m vtrain_plugin.cli ARGS``; its exit code, stdout and the
    modules it imported, with their top-level packages (importtime lists every module the process
    imports, on stderr)."""
    env = {**os.environ, "VTRAIN_CACHE_DIR": str(cache), "VTRAIN_PROFILE_DB": str(tmp_path / "profiles.sqlite")}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "vtrain_plugin.cli", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    modules = {line.rsplit("|", 1)[1].strip()
               for line in proc.stderr.splitlines() if line.startswith("import time:") and "|" in line}
    return proc, modules | {name.split(".")[0] for name in modules}


def test_warm_estimate_is_byte_identical_and_loads_neither_megatron_nor_torch(tmp_path, run_cli):
    cache = tmp_path / "cache"
    cold, cold_packages = _imported_modules(cache, tmp_path, "estimate", PLAN, "--format", "json")
    assert cold.returncode == 0, cold.stderr[-2000:]
    assert {"megatron", "torch"} <= cold_packages  # the check below can fail: a cold run traces
    assert len(_entries(cache)) == 1
    warm, warm_packages = _imported_modules(cache, tmp_path, "estimate", PLAN, "--format", "json")
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout == cold.stdout
    assert "megatron" not in warm_packages and "torch" not in warm_packages
    # nor the layers a plan file's estimate does not use: the Megatron-LM reader, measured runs, planning
    assert not {name for name in warm_packages
                if name.startswith(("vtrain_plugin.specs.megatron", "vtrain_plugin.measured", "vtrain_plugin.planning"))}
    # nor tracing's process machinery, the temporary-file writer, or importlib's package-resource readers
    assert not {"vtrain_plugin.capture.child_trace", "subprocess", "tempfile", "importlib.resources"} & warm_packages
    again = run_cli("estimate", PLAN, "--format", "json", env={"VTRAIN_CACHE_DIR": str(cache)}, check=True)
    assert again.stdout == cold.stdout


def test_a_config_error_loads_neither_megatron_nor_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"num_layers": 0}}))
    proc, packages = _imported_modules(tmp_path / "cache", tmp_path, "estimate", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(f"vtrain: error: {bad}: ")
    assert "megatron" not in packages and "torch" not in packages
    # nor the plotting and table libraries (a third of a second each; cluster-sim once loaded them)
    assert "matplotlib" not in packages and "pandas" not in packages


def test_help_of_every_command_loads_neither_megatron_nor_torch(tmp_path):
    proc, packages = _imported_modules(tmp_path / "cache", tmp_path, "--help")
    assert proc.returncode == 0 and "estimate" in proc.stdout
    assert "megatron" not in packages and "torch" not in packages


def test_no_cache_writes_nothing(tmp_path, run_cli):
    cache = tmp_path / "cache"
    run_cli("estimate", PLAN, "--no-cache", env={"VTRAIN_CACHE_DIR": str(cache)}, check=True)
    run_cli("trace", PLAN, env={"VTRAIN_CACHE_DIR": str(cache), "VTRAIN_NO_CACHE": "1"}, check=True)
    assert not cache.exists()


def test_cache_dir_flag_wins_over_the_environment_and_cache_command(tmp_path, run_cli):
    from_env, from_flag = tmp_path / "env", tmp_path / "flag"
    env = {"VTRAIN_CACHE_DIR": str(from_env)}
    run_cli("trace", PLAN, "--cache-dir", str(from_flag), env=env, check=True)
    assert not from_env.exists() and len(_entries(from_flag)) == 1
    info = run_cli("cache", "info", "--cache-dir", str(from_flag), env=env, check=True, fresh=True)  # plain subprocess
    assert info.stdout.startswith(f"trace cache {from_flag / 'traces'}: 1 trace(s), ")
    assert f"\ntask graphs {from_flag / 'task_graphs'}: 0 graph(s), 0.00 MB" in info.stdout
    cleared = run_cli("cache", "clear", env={"VTRAIN_CACHE_DIR": str(from_flag)}, check=True)
    assert cleared.stdout == (f"removed 1 trace(s) from {from_flag / 'traces'}\n"
                              f"removed 0 task graph(s) from {from_flag / 'task_graphs'}\n")
    assert _entries(from_flag) == []


def test_a_repeated_search_starts_warm_from_what_its_workers_traced(tmp_path):
    """Spawned workers write the traces; the next search (here in one process) reads them back."""
    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(yaml.safe_dump({"model": SEARCH_MODEL, "training": {"global_batch_size": 8},
                                          "cluster": {"preset": "dgx-a100"}}))
    cache = tmp_path / "cache"
    cold, _ = _imported_modules(cache, tmp_path, "search", str(model_file), *SEARCH_ARGS, "--workers", "2")
    assert cold.returncode == 0, cold.stderr[-2000:]
    assert len(_entries(cache)) == 12  # 4 trace shapes of 1 to 3 chunk roles (see test_search.py)
    warm, packages = _imported_modules(cache, tmp_path, "search", str(model_file), *SEARCH_ARGS, "--workers", "1")
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout == cold.stdout
    assert "megatron" not in packages and "torch" not in packages
