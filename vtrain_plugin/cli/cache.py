"""``vtrain cache info|clear``: the on-disk trace cache and the task graphs stored beside it (where,
how full, emptying them)."""

from __future__ import annotations

import argparse
import sys

from vtrain_plugin.cli.commands import Command
from vtrain_plugin.capture import disk_cache
from vtrain_plugin.sim import task_graph


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("info", "clear"), help="info: location, entries and size; clear: remove them")
    p.add_argument("--cache-dir", metavar="DIR", help="trace cache folder (default: $VTRAIN_CACHE_DIR, else the user cache)")


def run(args: argparse.Namespace) -> int:
    """(``--cache-dir`` is in the environment already: the CLI's main applies it to every command.)"""
    graphs_dir = task_graph.task_graphs_dir()
    if args.action == "clear":
        removed = disk_cache.clear()
        graphs = disk_cache.clear(graphs_dir, task_graph.SUFFIX)
        sys.stdout.write(f"removed {removed} trace(s) from {disk_cache.traces_dir()}\n"
                         f"removed {graphs} task graph(s) from {graphs_dir}\n")
        return 0
    info = disk_cache.info()
    graphs = disk_cache.info(graphs_dir, task_graph.SUFFIX)
    state = "" if disk_cache.enabled() else f" (off: {disk_cache.NO_CACHE_ENV} is set)"
    sys.stdout.write(f"trace cache {info.directory}{state}: {info.entries} trace(s), {info.nbytes / 1e6:.2f} MB "
                     f"of at most {info.max_bytes / 1e6:,.0f} MB ({disk_cache.MAX_MB_ENV})\n"
                     f"task graphs {graphs.directory}: {graphs.entries} graph(s), {graphs.nbytes / 1e6:.2f} MB "
                     f"of at most {graphs.max_bytes / 1e6:,.0f} MB\n")
    return 0


COMMANDS = (Command(name="cache", add_arguments=add_arguments, run=run,
                    help="show or clear the on-disk trace cache and its task graphs"),)
