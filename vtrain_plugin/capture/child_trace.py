"""Tracing chunks in a child process when this process's ``torch.distributed`` is in use.

A megatron-core chunk is traced on a fake process group of vtrain's own, with megatron-core's
parallel state set up for the traced layout and a few CUDA entry points patched to CPU stand-ins
(:mod:`megatron_adapters.fake_world`, :mod:`megatron_adapters.cpu_patches`). A process has one
default process group and one megatron-core parallel state; in a training script, whose process
groups are up, both belong to the script. Swapping them out under it is not safe (torch keeps part
of that state in C++ registries that ``destroy_process_group`` clears wholesale, and the script's
other threads would see the stand-ins), so the chunks are then traced in a fresh interpreter
(``python -m vtrain_plugin.capture.child_trace``): it gets the model, the plan and the chunk roles
as JSON and writes the chunk traces back as JSON. The script's groups, parallel state, RNG trackers
and torch functions are never touched; the child costs one import of torch and megatron-core.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vtrain_plugin.capture.chunk import ChunkTrace
from vtrain_plugin.core.errors import ConfigError, TraceError, VTrainError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan

# (pre_process, post_process, layers built: a count, or the kinds of a model that mixes MoE and
# dense layers, True for MoE)
Role = tuple[bool, bool, int | tuple[bool, ...]]
_ERRORS: dict[str, type[VTrainError]] = {"ConfigError": ConfigError, "TraceError": TraceError}


def distributed_in_use() -> bool:
    """Whether this process has a default process group (torch not imported: it cannot have one)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def trace_chunks(model: ModelSpec, plan: ParallelPlan, roles: list[Role]) -> list[ChunkTrace]:
    """The traces of ``roles``, in this process when it holds no process group, else in a child."""
    if not distributed_in_use():
        return _trace_here(model, plan, roles)
    with tempfile.TemporaryDirectory(prefix="vtrain-trace-") as folder:
        out = Path(folder) / "traces.json"
        request = {"model": model.to_dict(), "plan": plan.to_dict(), "roles": roles, "out": str(out)}
        proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request), text=True,
                              capture_output=True, env=_child_environment(), check=False)
        reply = json.loads(out.read_text()) if out.exists() else None
    if reply is None:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise TraceError(f"the tracing process exited with code {proc.returncode}"
                         f"{': ' + lines[-1] if lines else ''}")
    if "error" in reply:
        raise _ERRORS[reply["error"]["kind"]](reply["error"]["message"])
    return [ChunkTrace.from_dict(d) for d in reply["traces"]]


def _trace_here(model: ModelSpec, plan: ParallelPlan, roles: list[Role]) -> list[ChunkTrace]:
    # torch and megatron-core are loaded here, when a chunk must really be traced, and only then.
    from vtrain_plugin.capture.megatron_chunk import trace_chunk

    with _collector_skips_older_objects():
        return [trace_chunk(model, plan, pre, post, built) for pre, post, built in roles]


_own_process = False  # set by the processes vtrain starts for itself (search workers): see below


def own_this_process() -> None:
    """Mark this process as one vtrain started for its own work (a search worker): objects made
    before a trace may then stay out of the garbage collector's walks for the process's life."""
    global _own_process
    _own_process = True


@contextmanager
def _collector_skips_older_objects() -> Iterator[None]:
    """Objects made before the traces (torch's, megatron-core's, earlier traces', the caller's) left
    out of the cyclic garbage collector's walks while tracing.

    Why: each trace runs a full collection (the recorder collects dead cycles before it counts the
    saved activations) and allocates enough to start others, and each walked every object of the
    process: about 400,000 after the imports, and more with every trace a search worker keeps. Objects
    older than the traces are never garbage made by them, so what a trace collects is the same. In a
    process of nothing frozen they are given back after; in one of vtrain's own workers (which froze
    its parent's objects when it started) they stay frozen; where any other code froze objects, there
    is no telling which to give back, so it is left as it is."""
    if gc.get_freeze_count() and not _own_process:
        yield
        return
    given_back = not gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if given_back:
            gc.unfreeze()


def _child_environment() -> dict[str, str]:
    """This environment, with this interpreter's import path: the child imports the same vtrain and
    megatron-core, wherever the script found them."""
    path = [p for p in sys.path if p and os.path.isdir(p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    model, plan = ModelSpec(**request["model"]), ParallelPlan(**request["plan"])
    roles = [(bool(pre), bool(post), int(built) if isinstance(built, int) else tuple(bool(k) for k in built))
             for pre, post, built in request["roles"]]
    try:
        return {"traces": [t.to_dict() for t in _trace_here(model, plan, roles)]}
    except (ConfigError, TraceError) as exc:
        return {"error": {"kind": type(exc).__name__, "message": str(exc)}}


if __name__ == "__main__":
    _request = json.load(sys.stdin)
    atomic_write_text(Path(_request["out"]), json.dumps(_serve(_request)))
