"""core/files.py: atomic writes leave files with the mode ``open()`` would give them."""

import os
import stat

import pytest

from vtrain_plugin.core.files import atomic_write_bytes, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_honours_the_umask(tmp_path, umask, expected):
    saved = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "out.txt", "x\n")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x\n")
    finally:
        os.umask(saved)
    assert _mode(tmp_path / "out.txt") == expected == _mode(tmp_path / "plain.txt")
    assert (tmp_path / "out.txt").read_text() == "x\n"


def test_rewrite_keeps_the_existing_mode(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    path.chmod(0o640)
    atomic_write_bytes(path, b"new")
    assert _mode(path) == 0o640 and path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]  # no temporary file left behind
