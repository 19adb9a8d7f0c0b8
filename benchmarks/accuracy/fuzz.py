"""Hostile input files against ``load_run_config`` + ``estimate``: how many end unclean.

Generates ``--count`` examples with the strategies of ``tests/support/fuzzing.py`` (mutated plan files and
vTrain configs, damaged bytes, pathological documents), estimates each as ``vtrain estimate`` does,
and prints a table of outcomes: ``clean`` is an estimate with finite numbers or a one-line
``VTrainError``; anything else (another exception, a non-finite number, a multi-line error, an
example over the time limit) is non-clean and listed. Goal (issue 10): 0 non-clean of 10,000.

Run with ``.venv/bin/python -m benchmarks.accuracy.fuzz [--count 10000] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings
from tqdm import tqdm

from tests.support.fuzzing import CLEAN, TIME_LIMIT_S, Example, Outcome, examples, outcome


def fuzz(count: int, random_seed: int, folder: Path) -> list[tuple[Example, Outcome]]:
    results: list[tuple[Example, Outcome]] = []
    progress = tqdm(total=count, unit="file", file=sys.stderr)

    @seed(random_seed)
    @settings(max_examples=count, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(examples)
    def one(example: Example) -> None:
        results.append((example, outcome(example, folder)))
        progress.update()

    one()
    progress.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("VTRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="vtrain-fuzz-cache-"))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vtrain-fuzz-") as folder:
        results = fuzz(args.count, args.seed, Path(folder))
    wall = time.perf_counter() - start
    kinds = collections.Counter(o.kind for _, o in results)
    estimates = sum(1 for _, o in results if o.kind == CLEAN and o.detail == "estimate")
    seconds = sorted(o.seconds for _, o in results)
    print(f"{len(results):,} examples (seed {args.seed}) in {wall:.0f} s; "
          f"{estimates:,} estimated, {kinds[CLEAN] - estimates:,} refused with one line")
    print(f"per example: median {statistics.median(seconds) * 1e3:.1f} ms, max {seconds[-1]:.2f} s "
          f"(limit {TIME_LIMIT_S} s)")
    print(f"{'outcome':<18}{'count':>8}")
    for kind, n in sorted(kinds.items(), key=lambda item: (item[0] != CLEAN, item[0])):
        print(f"{kind:<18}{n:>8,}")
    non_clean = [(e, o) for e, o in results if o.kind != CLEAN]
    print(f"non-clean: {len(non_clean):,} of {len(results):,}")
    for example, result in non_clean[:50]:
        print(f"  {result.kind}: {example.name} ({example.mutation}): {result.detail}")
    return 1 if non_clean else 0


if __name__ == "__main__":
    sys.exit(main())
