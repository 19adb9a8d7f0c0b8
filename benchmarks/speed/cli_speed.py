"""Wall time of ``vtrain`` commands from the shell: cold and warm estimates, a config error, ``--help``.

Each case runs the CLI as a new process (``python -m vtrain_plugin.cli ...``, what the ``vtrain``
script runs), several times; the table gives the median and best wall time and the median CPU time
(user + system) of the process. Cold: an empty trace cache (a new folder per run), so the plan is
traced. Warm: the same plan again with the cache filled by a first run. Config error: the plan with
``num_layers`` 0 (vTrain config: ``num_layers``), reported before anything is traced. The machine's
load average is printed with the table: on a shared machine, wall time above CPU time is time spent
waiting for a core. Target (issue 32): a warm estimate under 0.3 s. Whether the processes write and
reuse bytecode (``PYTHONDONTWRITEBYTECODE`` unset) is printed too: without it every process compiles
vtrain's modules from source, part of a warm estimate's start-up.

Run with ``.venv/bin/python -m benchmarks.speed.cli_speed [--repeats N] [--cold-repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from vtrain_plugin.cli.render import render_table

REPO = Path(__file__).resolve().parents[2]
PLANS = ("examples/configs/gpt3_175b_512gpu.json", "examples/plans/llama2_70b_512gpu.yaml")


def run_cli(args: list[str], cache_dir: Path, expect: int = 0) -> tuple[float, float]:
    """Wall and CPU seconds of one ``vtrain ARGS`` process."""
    env = {**os.environ, "VTRAIN_CACHE_DIR": str(cache_dir)}
    env.pop("VTRAIN_NO_CACHE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vtrain_plugin.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != expect:
        raise SystemExit(f"vtrain {' '.join(args)} exited {proc.returncode}, not {expect}:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def broken_copy(plan: str, folder: Path) -> Path:
    """``plan`` with ``num_layers`` 0: one config error, named by the CLI, exit code 2."""
    path = REPO / plan
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        data["num_layers"] = 0
        out = folder / f"broken_{path.name}"
        out.write_text(json.dumps(data))
    else:
        data = yaml.safe_load(path.read_text())
        data["model"]["num_layers"] = 0
        out = folder / f"broken_{path.name}"
        out.write_text(yaml.safe_dump(data))
    return out


def timed(label: str, plan: str, runs: list[tuple[float, float]]) -> list[str]:
    walls = [w for w, _ in runs]
    return [label, plan, str(len(runs)), f"{statistics.median(walls):.2f}", f"{min(walls):.2f}",
            f"{statistics.median(c for _, c in runs):.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="runs of each fast case (default 7)")
    parser.add_argument("--cold-repeats", type=int, default=3, help="runs of each cold estimate (default 3)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vtrain-cli-speed-") as tmp:
        tmp_path = Path(tmp)
        rows.append(timed("vtrain --help", "-", [run_cli(["--help"], tmp_path / "help") for _ in range(args.repeats)]))
        for plan in PLANS:
            name = Path(plan).name
            broken = broken_copy(plan, tmp_path)
            rows.append(timed("config error", name, [run_cli(["estimate", str(broken)], tmp_path / "error", expect=2)
                                                     for _ in range(args.repeats)]))
            cold = [run_cli(["estimate", plan], tmp_path / f"cold-{name}-{i}") for i in range(args.cold_repeats)]
            rows.append(timed("estimate, cold (traces)", name, cold))
            warm_dir = tmp_path / f"cold-{name}-0"  # filled by the first cold run
            rows.append(timed("estimate, warm (trace cache)", name,
                              [run_cli(["estimate", plan], warm_dir) for _ in range(args.repeats)]))
    load_after = os.getloadavg()
    print(render_table(rows, ["case", "plan", "runs", "median wall s", "best wall s", "median CPU s"]))
    bytecode = "off (PYTHONDONTWRITEBYTECODE set)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "on"
    print(f"\n{os.cpu_count()} CPUs; load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"bytecode cache {bytecode}")


if __name__ == "__main__":
    main()
