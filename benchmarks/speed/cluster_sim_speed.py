"""Speed of ``vtrain cluster-sim`` on the issue's acceptance command, cold and warm.

Runs ``vtrain cluster-sim --generate 100 --seed 1 --nodes 128 --gpu A100 --policy all --format json``
in a subprocess with its own cache folder: first empty (every throughput curve is searched: each
new chunk shape traced, then every plan estimated), then as that run left it (curves read from
disk: only imports, the three simulations and the report remain), then with the traces but not the
curves (as for a new cluster size or global batch: the estimates of every plan remain). Prints
wall-clock and CPU seconds (the machine is shared, so CPU time is the steadier figure), the load
average at the start, the curves on disk, and the last run's report. Extra arguments after ``--``
(``-- --slack 1.2``) go to the command. Not a test: ``.venv/bin/python -m benchmarks.speed.cluster_sim_speed``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
COMMAND = ["cluster-sim", "--generate", "100", "--seed", "1", "--nodes", "128", "--gpu", "A100", "--policy", "all",
           "--format", "json"]


def timed(args: list[str], cache: Path) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of the child, its JSON report)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vtrain_plugin.cli", *args, "--cache-dir", str(cache)],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"vtrain {' '.join(args)} failed:\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("extra", nargs="*", help="more arguments for the command (after --)")
    extra = parser.parse_args().extra
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold (empty cache)", "warm (cached curves)", "cached traces only"):
            if label == "cached traces only":
                shutil.rmtree(Path(cache) / "curves")
            load = os.getloadavg()[0]
            wall, cpu, report = timed([*COMMAND, *extra], Path(cache))
            curves = len(list((Path(cache) / "curves").glob("*.json")))
            rows.append((label, wall, cpu, load, curves))
    print(f"vtrain {' '.join([*COMMAND, *extra])}   ({os.cpu_count()} cores)")
    print(f"{'run':<22}{'wall s':>9}{'CPU s':>9}{'load avg':>10}{'curves':>8}")
    for label, wall, cpu, load, curves in rows:
        print(f"{label:<22}{wall:>9.1f}{cpu:>9.1f}{load:>10.2f}{curves:>8}")
    print()
    summary = pd.DataFrame(report["policies"]).drop(columns="outcomes")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:,.3f}"))


if __name__ == "__main__":
    main()
