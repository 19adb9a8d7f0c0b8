"""Every example of README.md and docs/*.md runs (issue 34).

A fenced block whose info string is ``bash`` or ``python`` is an example and is run from the
repository root: bash blocks with ``vtrain`` as this checkout's CLI (``set -e -o pipefail``), python
blocks as a script. ``bash gpu`` / ``python gpu`` blocks need a CUDA device and are skipped without
one; ``python sketch`` blocks show code that needs the user's own objects (a training script's
model and data) and are skipped with that reason. Transcripts (a command and what it printed) are ``console`` blocks and are not run; a bare
fence that holds a command or Python is an error, so no example escapes the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.M | re.S)
RUNNABLE = {"bash", "python"}


def _blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            info = m.group(1).split()
            line = text.count("\n", 0, m.start()) + 1
            yield page.relative_to(REPO).as_posix(), line, info, m.group(2)


def _examples():
    for page, line, info, code in _blocks():
        if info and info[0] in RUNNABLE:
            yield pytest.param(info[0], info[1:], code, id=f"{page}:{line}")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("language, tags, code", list(_examples()))
def test_example_runs(language: str, tags: list[str], code: str, tmp_path: Path) -> None:
    if "sketch" in tags:
        pytest.skip("a sketch: needs the user's own training script")
    if "gpu" in tags and not _has_cuda():
        pytest.skip("needs a CUDA device")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "VTRAIN_EXAMPLE_OUT": str(tmp_path)}
    if language == "bash":
        script = (f'set -e -o pipefail\nvtrain() {{ "{sys.executable}" -m vtrain_plugin.cli "$@"; }}\n'
                  f'python() {{ "{sys.executable}" "$@"; }}\n{code}')
        cmd = ["bash", "-c", script]
    else:
        path = tmp_path / "example.py"
        path.write_text(code, encoding="utf-8")
        cmd = [sys.executable, str(path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def test_every_example_is_tagged() -> None:
    """A bare fence holding a command or Python would be an example nobody runs: tag it bash or
    python (run), or console (a transcript, not run)."""
    untagged = [f"{page}:{line}" for page, line, info, code in _blocks()
                if not info and re.match(r"\s*(\$ )?(vtrain|python|import|from \w+ import|make )", code)]
    assert not untagged, f"untagged examples (use ```bash, ```python or ```console): {untagged}"


def test_pages() -> None:
    """The manual's shape: README within 300 lines, at least five pages of docs, each linked from it."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert len(pages) >= 5
    assert [p for p in pages if f"docs/{p}" not in readme] == []
