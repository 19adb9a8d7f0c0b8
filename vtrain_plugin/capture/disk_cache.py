"""The on-disk trace cache: chunk traces stored content-addressed under the user's cache folder.

An entry is one traced chunk role (:class:`~vtrain_plugin.capture.chunk.ChunkTrace`), stored as
its plain-data form, the blocks as tables (``to_tables``), in Python's ``marshal`` format, gzipped, in ``<cache
dir>/traces/<sha256 of its key>.marshal.gz``: marshal reads plain data several times faster than
JSON, and reading entries is most of a warm estimate. The key is the chunk's shape key
(:func:`~vtrain_plugin.capture.chunk.shape_key`, field by field) plus :func:`versions`: of Python
(marshal's format is one release's), vtrain, torch and megatron-core, of the graph schema and of
this entry format, and a digest of the source of the code a trace runs (so an edited checkout never
reads traces of older code).
Entries read in one process share their equal kernel keys, nodes and blocks' node tuples
(:class:`~vtrain_plugin.capture.node_table.SharedNodes`): what the costing keeps per node tuple (a
block's lowering) serves every chunk role that holds the same layer.
The entry holds its own key: one whose key differs from the one asked for (another version, a
hash collision), or that cannot be read back (corrupt, truncated), is ignored with a debug log
and traced again, and the new trace overwrites it. Entries are written atomically, so processes
that share the folder (the workers of a plan search) never see half of one.

Settings, all read from the environment so that worker processes inherit them (the CLI's
``--cache-dir`` and ``--no-cache`` set them):

- ``VTRAIN_CACHE_DIR``: the cache folder (default ``$XDG_CACHE_HOME/vtrain``, else ``~/.cache/vtrain``);
- ``VTRAIN_NO_CACHE=1``: neither read nor write entries;
- ``VTRAIN_CACHE_MAX_MB``: the size above which the least recently used entries are removed
  after a write (default :data:`DEFAULT_MAX_MB`; a hit marks an entry as used).
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import json
import logging
import marshal
import os
import re
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vtrain_plugin.capture.chunk import ChunkTrace, named_shape_key
from vtrain_plugin.capture.node_table import SharedNodes
from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.files import atomic_write_bytes, user_cache_dir
from vtrain_plugin.core.graph import SCHEMA_VERSION

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "VTRAIN_CACHE_DIR"
NO_CACHE_ENV = "VTRAIN_NO_CACHE"
MAX_MB_ENV = "VTRAIN_CACHE_MAX_MB"
DEFAULT_MAX_MB = 512  # a GPT-3 175B chunk is about 16 kB gzipped; thousands of shapes fit
ENTRY_FORMAT = 4  # 2: params_by_block holds each parameter's elements (was a count per block); 3: marshal;
# 4: blocks as tables (vtrain_plugin.capture.node_table)
SUFFIX = ".marshal.gz"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
# The packages whose source a chunk trace runs: a change to any of their files is a new key.
_TRACED_CODE = ("vtrain_plugin/capture", "vtrain_plugin/core", "vtrain_plugin/specs", "megatron_adapters")
_REPO = Path(__file__).resolve().parents[2]


def enabled() -> bool:
    """Whether the disk cache is in use (``VTRAIN_NO_CACHE`` unset or false)."""
    value = os.environ.get(NO_CACHE_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{NO_CACHE_ENV} must be one of {', '.join(_TRUE)} (cache off) or "
                          f"{', '.join(repr(x) if not x else x for x in _FALSE)} (cache on), got {value!r}")
    return value not in _TRUE


def cache_dir() -> Path:
    """``$VTRAIN_CACHE_DIR``, else vtrain's folder in the user cache; traces live in its ``traces``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else user_cache_dir()


def traces_dir() -> Path:
    return cache_dir() / "traces"


def max_bytes() -> int:
    text = os.environ.get(MAX_MB_ENV)
    if not text:
        return DEFAULT_MAX_MB * 10**6
    try:
        mb = float(text)
    except ValueError:
        raise ConfigError(f"{MAX_MB_ENV} must be a size in MB such as 512, got {text!r}") from None
    return int(v.positive_finite_number(MAX_MB_ENV, mb) * 10**6)


def versions() -> dict[str, Any]:
    """What besides the shape a stored trace depends on: the software that traced it."""
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "vtrain": _package_version("vtrain"), "torch": _package_version("torch"),
            "megatron-core": _package_version("megatron-core"), "graph_schema": SCHEMA_VERSION,
            "entry_format": ENTRY_FORMAT, "traced_code": _traced_code_digest()}


def entry_key(key: tuple) -> dict[str, Any]:
    """The full key of the entry of shape key ``key``, as stored in the entry."""
    return {"shape": named_shape_key(key), "versions": versions()}


def entry_path(key: tuple) -> Path:
    return traces_dir() / f"{hashlib.sha256(_canonical(entry_key(key)).encode()).hexdigest()}{SUFFIX}"


def load(key: tuple) -> ChunkTrace | None:
    """The stored trace of shape key ``key``; None when the cache is off or has no valid entry."""
    if not enabled():
        return None
    path = entry_path(key)
    with _collector_paused():
        chunk = _read(path, key)
    if chunk is not None:
        touch(path)
    return chunk


# What the entries read here have built, for the next ones to share (node_table.SharedNodes).
_shared = SharedNodes()


def _read(path: Path, key: tuple) -> ChunkTrace | None:
    try:
        data = marshal.loads(gzip.decompress(path.read_bytes()))
    except FileNotFoundError:
        return None
    except (OSError, EOFError, zlib.error, ValueError, TypeError) as exc:  # unreadable, truncated, corrupt
        log.debug("trace cache: ignoring %s (%s: %s)", path, type(exc).__name__, exc)
        return None
    if not isinstance(data, dict) or _canonical(data.get("key")) != _canonical(entry_key(key)):
        log.debug("trace cache: ignoring %s, an entry of another key (other versions or a hash collision)", path)
        return None
    try:
        return ChunkTrace.from_tables(data["chunk"], _shared)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        log.debug("trace cache: ignoring %s (malformed: %s: %s)", path, type(exc).__name__, exc)
        return None


_freeze_reads = False  # set in vtrain's own worker processes: see keep_reads_frozen


def keep_reads_frozen() -> None:
    """For a process vtrain started for its own work (a search worker): the entries it reads, and
    whatever the process made before, stay out of the garbage collector's walks for its life."""
    global _freeze_reads
    _freeze_reads = True


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while an entry is decoded: decoding makes thousands of
    containers, none of them garbage and none in a cycle, and the collections they would trigger
    scan every object of the process (most of a read's time in a search worker otherwise). In a
    process that keeps its reads frozen (:func:`keep_reads_frozen`) they are frozen before the
    collector is back on: the first collection after a read would otherwise walk the whole entry,
    and the later ones again as it ages (frozen objects are still freed when no longer referenced;
    only cycles among them would stay)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _freeze_reads:
            gc.freeze()
        if enabled:
            gc.enable()


def contains(key: tuple) -> bool:
    """Whether the cache is on and has an entry at the path of shape key ``key`` (not read: an
    entry of another key or a corrupt one is found invalid, and traced again, on :func:`load`)."""
    return enabled() and entry_path(key).exists()


def store(key: tuple, chunk: ChunkTrace) -> None:
    """Write the trace of shape key ``key`` (atomically), then keep the cache within its size.

    A cache that cannot be written is a warning, not an error: the trace itself succeeded.
    """
    if not enabled():
        return
    path = entry_path(key)
    # through JSON first: plain types only (marshal refuses a str or int subclass, an enum member)
    data = marshal.dumps(json.loads(json.dumps({"key": entry_key(key), "chunk": chunk.to_tables()})))
    try:
        atomic_write_bytes(path, gzip.compress(data, compresslevel=6, mtime=0))
        prune(path.parent, max_bytes())
    except OSError as exc:
        log.warning("trace cache: could not write %s (%s); continuing without it", path, exc)


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheInfo:
    directory: Path
    entries: int
    nbytes: int
    max_bytes: int


def info(directory: Path | None = None, suffix: str = SUFFIX) -> CacheInfo:
    """The entries of the trace folder, or of another folder of the cache (files ending in ``suffix``)."""
    directory = traces_dir() if directory is None else directory
    files = _entries(directory, suffix)
    return CacheInfo(directory=directory, entries=len(files), nbytes=sum(size for _, size, _ in files),
                     max_bytes=max_bytes())


def clear(directory: Path | None = None, suffix: str = SUFFIX) -> int:
    """Remove every entry of the trace folder (or of ``directory``: files ending in ``suffix``);
    returns how many were removed."""
    files = _entries(traces_dir() if directory is None else directory, suffix)
    for path, _, _ in files:
        path.unlink(missing_ok=True)
    return len(files)


def prune(directory: Path, limit: int, suffix: str = SUFFIX) -> None:
    """Remove the least recently used entries (files ending in ``suffix``) of ``directory`` until they
    take at most ``limit`` bytes."""
    files = _entries(directory, suffix)
    total = sum(size for _, size, _ in files)
    for path, size, _ in sorted(files, key=lambda f: f[2]):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size
        log.debug("trace cache: removed %s (least recently used; cache above %d bytes)", path, limit)


def _entries(directory: Path, suffix: str = SUFFIX) -> list[tuple[Path, int, float]]:
    """``(path, bytes, last use)`` of every entry; entries another process removes meanwhile are skipped."""
    found = []
    try:
        paths = list(directory.glob(f"*{suffix}"))
    except OSError:
        return []
    for path in paths:
        try:
            stat = path.stat()
        except OSError:
            continue
        found.append((path, stat.st_size, stat.st_mtime))
    return found


def touch(path: Path) -> None:
    """Mark an entry as used now (its modification time orders the pruning)."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache still serves its entries


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=None)
def _package_version(name: str) -> str | None:
    """The installed version of distribution ``name``: from the name of its ``.dist-info`` folder on
    ``sys.path`` (the first, as importlib.metadata finds it), else importlib.metadata itself, which
    takes longer to load than a warm estimate takes to run."""
    wanted = _normalized(name)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            project, _, version = folder.removesuffix(".dist-info").partition("-")
            if folder.endswith(".dist-info") and version and _normalized(project) == wanted:
                return version
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _normalized(project: str) -> str:
    """A distribution name as PEP 503 compares them (``megatron-core`` is ``megatron_core``)."""
    return re.sub(r"[-_.]+", "_", project).lower()


@lru_cache(maxsize=1)
def _traced_code_digest() -> str:
    """SHA-256 of the source files of :data:`_TRACED_CODE`, by path: same version number, other code,
    other key (an editable install or a checkout under development)."""
    digest = hashlib.sha256()
    for package in _TRACED_CODE:
        for path in sorted((_REPO / package).rglob("*.py")):
            digest.update(path.relative_to(_REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
