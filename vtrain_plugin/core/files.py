"""Writing files so that readers never see half of one."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    The file gets the mode ``open()`` would give it: an existing file's own, a new one
    ``0o666`` less the umask (``mkstemp`` alone makes every file ``0o600``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode_for(path)
    import tempfile  # here: it loads shutil and random, which a command that writes nothing never needs

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_for(path: Path) -> int:
    """The permission bits ``open(path, "w")`` leaves ``path`` with."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # the only portable way to read it is to set it; put back at once
        os.umask(umask)
        return 0o666 & ~umask


def user_cache_dir() -> Path:
    """vtrain's folder in the user's cache: ``$XDG_CACHE_HOME/vtrain``, else ``~/.cache/vtrain``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "vtrain"
