"""Where the CPU time of one warm ``vtrain estimate`` process goes, phase by phase.

    VTRAIN_CACHE_DIR=DIR .venv/bin/python -m benchmarks.speed.startup [PLAN] [--repeats N]

Fresh processes, the trace cache in DIR filled by a first run and no result cached: the interpreter
(``python -c pass``), the imports by package (``-X importtime`` self times, scaled to the measured
import CPU), then the command's own phases, each timed in CPU seconds by wrapping the function that
does it: config parsing, the trace-cache read, the profile-database look-up, prepare, cost, simulate,
summary and render; then the process's exit. Why: issue 32 wants a warm single estimate under 0.3 s, and the breakdown says
which part to cut. Medians over the repeats; on a shared machine compare CPU, not wall, figures.
"""

from __future__ import annotations

import time

_START_CPU_S = time.process_time()  # the interpreter and site, before anything else loads

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PLAN = "examples/plans/qwen3_8b_64gpu_h100.yaml"
# phase -> (module, function name): the function whose CPU time is the phase
PHASES = {
    "trace-cache read": ("vtrain_plugin.estimate", "trace"),
    "profile database": ("vtrain_plugin.estimate", "measured_for_graph"),
    "prepare": ("vtrain_plugin.estimate", "prepare_run"),
    "cost": ("vtrain_plugin.estimate", "cost"),
    "simulate": ("vtrain_plugin.estimate", "simulate"),
    "summary": ("vtrain_plugin.estimate", "_summarize"),
    "render": ("vtrain_plugin.cli.render", "estimate_table"),
}
HEAVY = ("torch", "megatron", "pandas", "yaml", "numpy", "sqlite3")


def child(plan: str) -> None:
    """One estimate in this process, through the program's own entry (``vtrain_plugin.cli.console``, as
    ``python -m vtrain_plugin.cli`` runs it); prints ``phase seconds`` lines on stderr, the last one
    the CPU seconds spent when the command returns (the rest of the process is its exit)."""
    import importlib

    spent: Counter[str] = Counter()

    def timed(phase: str, fn):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.process_time() - start
        return wrapper

    before = time.process_time()
    import vtrain_plugin.cli as cli
    spent["imports"] = time.process_time() - before
    real_main = cli.main

    def main() -> int:  # what console() runs: the command's imports, then the command, phase by phase
        before = time.process_time()
        cli.command_modules(["estimate"])
        owners = {module: importlib.import_module(module) for module, _ in PHASES.values()}  # the command's own
        spent["imports"] += time.process_time() - before
        for phase, (module, name) in PHASES.items():
            setattr(owners[module], name, timed(phase, getattr(owners[module], name)))
        command = importlib.import_module("vtrain_plugin.cli.estimate")
        run_inputs = command.run_inputs
        command.run_inputs = lambda *a, **k: [(label, timed("config parsing", load)) for label, load in run_inputs(*a, **k)]
        before = time.process_time()
        with open(os.devnull, "w") as sink:
            stdout, sys.stdout = sys.stdout, sink
            try:
                code = real_main(["estimate", plan])
            finally:
                sys.stdout = stdout
        spent["command, other"] = time.process_time() - before - sum(v for k, v in spent.items() if k != "imports")
        spent["interpreter (in this process)"] = _START_CPU_S
        for phase, seconds in spent.items():
            print(f"{phase}\t{seconds:.4f}", file=sys.stderr)
        print(f"loaded\t{' '.join(m for m in HEAVY if m in sys.modules) or '-'}", file=sys.stderr)
        print(f"returned\t{time.process_time():.4f}", file=sys.stderr)
        return code

    cli.main = main
    cli.console()


def run(argv: list[str]) -> tuple[float, str]:
    """CPU seconds (user + system) of ``python ARGV`` as a new process, and its stderr."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"python {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stderr


def import_shares(plan: str) -> dict[str, float]:
    """Each package's share of the import self time of ``vtrain estimate PLAN`` (``-X importtime``);
    vtrain's own packages by layer (``vtrain_plugin.cost``)."""
    _, err = run(["-X", "importtime", "-m", "vtrain_plugin.cli", "estimate", plan])
    by: Counter[str] = Counter()
    for line in err.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            parts = m[2].split(".")
            by[".".join(parts[:2]) if parts[0] == "vtrain_plugin" else parts[0]] += int(m[1])
    total = sum(by.values())
    return {name: us / total for name, us in by.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("plan", nargs="?", default=PLAN)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.plan)
    if "VTRAIN_CACHE_DIR" not in os.environ:
        raise SystemExit("set VTRAIN_CACHE_DIR to the trace cache to time (filled by a first run here)")
    load_before = os.getloadavg()[0]
    run(["-m", "vtrain_plugin.cli", "estimate", args.plan])  # fills the trace cache (and the bytecode)
    whole = [run(["-m", "vtrain_plugin.cli", "estimate", args.plan])[0] for _ in range(args.repeats)]
    interpreter = [run(["-c", "pass"])[0] for _ in range(args.repeats)]
    phases: dict[str, list[float]] = {}
    loaded = ""
    for _ in range(args.repeats):
        cpu_s, err = run(["-m", "benchmarks.speed.startup", "--child", args.plan])
        for line in err.splitlines():
            name, _, value = line.partition("\t")
            if name == "loaded":
                loaded = value
            elif name == "returned":
                phases.setdefault("exit (after the command returns)", []).append(cpu_s - float(value))
            elif value:
                phases.setdefault(name, []).append(float(value))
    imports_s = statistics.median(phases.pop("imports"))
    phases.pop("interpreter (in this process)", None)
    print(f"warm `vtrain estimate {args.plan}`, {args.repeats} fresh processes each, median CPU seconds")
    print(f"{'whole process (python -m vtrain_plugin.cli)':46s}{statistics.median(whole):8.3f}  "
          f"(best {min(whole):.3f})")
    print(f"{'  interpreter (python -c pass)':46s}{statistics.median(interpreter):8.3f}")
    print(f"{'  imports (vtrain_plugin.cli + the command)':46s}{imports_s:8.3f}")
    for name, share in import_shares(args.plan).items():
        if share >= 0.01:
            print(f"{'    ' + name:46s}{share * imports_s:8.3f}  ({share:.0%})")
    for name, values in phases.items():
        print(f"{'  ' + name:46s}{statistics.median(values):8.3f}")
    print(f"heavy modules loaded: {loaded}")
    bytecode = "off (PYTHONDONTWRITEBYTECODE set)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "on"
    print(f"{os.cpu_count()} CPUs; load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"bytecode cache {bytecode}")


if __name__ == "__main__":
    main()
