"""The tiny CPU plan the tests profile, and its profile: ``vtrain profile`` run once per test session
(in a plain subprocess, into the default ``$VTRAIN_PROFILE_DB``), its database and what it printed.

Why: profiling the plan's kernels is a minute of CPU, and two test modules read such a database
(test_profile_validate, test_profile_db_everywhere). Under pytest-xdist the workers share it through
the session's scratch folder, behind a lock: the first to ask profiles, the others wait and read.
Each test copies the database before it uses it, so no test sees another's writes.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Small enough to profile and train in seconds on two cores: every kernel's operands stay under the
# 4 MiB above which the CPU profiler writes 512 MiB between repetitions to flush the last-level cache
# (profiler/device_timing.py), the logits and attention scores included. What is checked with it does
# not depend on the size; benchmarks/device/validate_cpu.py measures the error on a larger plan.
TINY_PLAN = """
model: {name: gpt-test, num_layers: 2, hidden_size: 256, num_attention_heads: 4, seq_length: 128,
        vocab_size: 1024, dtype: fp32}
parallel: {micro_batch_size: 2}
training: {global_batch_size: 4}
cluster: {preset: local-cpu}
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyProfile:
    """The session's profile of :data:`TINY_PLAN`: copy ``db`` before use; ``stdout`` is what the
    first ``vtrain profile`` printed (every kernel measured into an empty database)."""

    db: Path
    stdout: str


def tiny_profile(folder: Path, python_m: Callable) -> TinyProfile:
    """Profile :data:`TINY_PLAN` into ``folder`` unless a process of the session already has."""
    folder.mkdir(parents=True, exist_ok=True)
    db, printed = folder / "profiles.sqlite", folder / "profile.stdout"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not printed.exists():
            plan = folder / "tiny.yaml"
            plan.write_text(TINY_PLAN)
            proc = python_m("vtrain_plugin.cli", "profile", str(plan), env={**os.environ, "VTRAIN_PROFILE_DB": str(db)},
                            fresh=True)  # the command once in a plain subprocess
            assert proc.returncode == 0, proc.stderr[-3000:]
            partial = folder / "profile.stdout.partial"
            partial.write_text(proc.stdout)
            partial.rename(printed)
    return TinyProfile(db=db, stdout=printed.read_text())
