"""The import contract of setup.cfg (import-linter): layers import only the layers below them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("vtrain_plugin", "megatron_adapters", "profiler")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", "setup.cfg", "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(cwd)}, timeout=300)


def test_the_tree_keeps_its_import_contracts():
    proc = _lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "6 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize("module, imports, broken", [
    ("core/synthetic.py", "vtrain_plugin.cost.memory", "vtrain_plugin.core is not allowed to import vtrain_plugin.cost"),
    ("cost/kernels/synthetic.py", "vtrain_plugin.cost.comm.topology",
     "vtrain_plugin.cost.kernels is not allowed to import vtrain_plugin.cost.comm"),
])
def test_the_contract_breaks_when_a_lower_layer_imports_a_higher_one(tmp_path, module, imports, broken):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(REPO / "setup.cfg", tmp_path / "setup.cfg")
    (tmp_path / "vtrain_plugin" / module).write_text(f"import {imports}\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert broken in proc.stdout
    assert f"vtrain_plugin.{module[:-3].replace('/', '.')} -> {imports}" in proc.stdout
