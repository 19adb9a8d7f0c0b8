"""Hostile input files for the property test (tests/unit/runs/test_fuzz.py) and ``benchmarks/accuracy/fuzz.py``.

Each example is the bytes of one input file and its name: a small plan file (YAML or JSON) or a
small vTrain config (JSON), either with its values mutated (a field set to a hostile value, to a
plausible neighbour, dropped, an unknown one added, a section replaced) or with its bytes damaged
(cut, bytes flipped, garbage or a NUL inserted) or replaced by a pathological document (deep
nesting, a YAML alias bomb, a huge number, a file past the size limit).

:func:`outcome` loads and estimates one file the way ``vtrain estimate`` does and classifies the
result: ``clean`` (an estimate whose numbers are finite, or a :class:`VTrainError` with a one-line
message) or a non-clean kind (``exception``, ``non-finite``, ``multi-line error``, ``slow``).
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from vtrain_plugin.runs import load_run_config
from vtrain_plugin.core.errors import VTrainError
from vtrain_plugin.estimate import estimate

PLAN = {
    "model": {"name": "fuzz-gpt", "family": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "seq_length": 64, "vocab_size": 512, "dtype": "bf16"},
    "parallel": {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 2, "micro_batch_size": 1},
    "training": {"global_batch_size": 8, "schedule": "1f1b", "grad_reduce": "overlap"},
    "cluster": {"preset": "dgx-a100"},
}
LLAMA_PLAN = {
    **PLAN,
    "model": {"name": "fuzz-llama", "family": "llama", "num_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 176, "seq_length": 64,
              "vocab_size": 512, "dtype": "bf16"},
    "training": {"global_batch_size": 8, "schedule": "1f1b", "grad_reduce": "overlap",
                 "distributed_optimizer": True},
    "cluster": {"preset": "dgx-h100"},
}
VTRAIN_CONFIG = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_length": 64, "vocab_size": 512,
    "num_gpus": 8, "tensor_parallel_size": 2, "data_parallel_size": 2, "pipeline_parallel_size": 2,
    "micro_batch_size": 1, "global_batch_size": 8, "pipeline_scheduling": "1f1b", "use_gradient_bucket": True,
    "ddp_bucket_size": None, "gpu_name": "A100", "use_checkpoint": True,
}
BASES = (("plan.yaml", PLAN), ("plan.json", PLAN), ("llama.yaml", LLAMA_PLAN), ("vtrain.json", VTRAIN_CONFIG))

CLEAN = "clean"
TIME_LIMIT_S = 60  # an example that takes longer is "slow" (the bar is a second or two for errors)


@dataclass(frozen=True, slots=True)
class Example:
    name: str  # the file name; its suffix picks the reader
    content: bytes
    mutation: str  # what was done to the base, for the report

    def __repr__(self) -> str:
        return f"Example({self.name!r}, {self.mutation}, {self.content[:200]!r}...)"


# -- values --------------------------------------------------------------------------------------

HOSTILE_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 10**12, 10**30, 2**63, 10**4000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
    st.booleans(),
    st.none(),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping, sections included."""
    if not isinstance(document, dict):
        return []
    found = []
    for key, value in document.items():
        found.append((*prefix, key))
        found.extend(_paths(value, (*prefix, key)))
    return found


def _set(document: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def _get(document: dict, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


def _neighbour(value: Any, factor: float) -> Any:
    """A plausible change: a number scaled (rounded for integers), anything else unchanged."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    scaled = value * factor
    return max(1, round(scaled)) if isinstance(value, int) else scaled


@st.composite
def _mutated_document(draw) -> tuple[str, dict, str]:
    name, base = draw(st.sampled_from(BASES))
    document = json.loads(json.dumps(base))
    done = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = _paths(document)
        kind = draw(st.sampled_from(["hostile", "neighbour", "neighbour", "drop", "unknown"]))
        if kind == "unknown" or not paths:
            key = draw(st.sampled_from(["extra", "num_layer", "tensor_paralel", "gpus", ""]))
            document[key] = draw(HOSTILE_VALUES)
            done.append(f"add {key!r}")
            continue
        path = draw(st.sampled_from(paths))
        if kind == "drop":
            parent = _get(document, path[:-1]) if len(path) > 1 else document
            del parent[path[-1]]
        elif kind == "neighbour":
            _set(document, path, _neighbour(_get(document, path), draw(st.sampled_from([0.5, 2, 3, 4, 16]))))
        else:
            _set(document, path, draw(HOSTILE_VALUES))
        done.append(f"{kind} {'.'.join(map(str, path))}")
    return name, document, "; ".join(done)


def _serialise(name: str, document: dict) -> bytes:
    if name.endswith(".yaml"):
        return yaml.safe_dump(document, allow_unicode=True).encode()
    return json.dumps(document).encode()  # NaN and Infinity written as JSON cannot: hostile too


def _damage(content: bytes, kind: str, at: int, byte: int = 0xFF, inserted: bytes = b"\x00{") -> bytes:
    if kind == "cut":
        return content[:at]
    if kind == "flip":
        return content[:at] + bytes([byte]) + content[at + 1:]
    return content[:at] + inserted + content[at:]


DAMAGES = ("cut", "flip", "insert")


@st.composite
def _damaged(draw) -> Example:
    name, document, mutation = draw(_mutated_document())
    content = _serialise(name, document)
    kind = draw(st.sampled_from(DAMAGES))
    at = draw(st.integers(min_value=0, max_value=len(content)))
    if kind == "cut":
        content = _damage(content, kind, at)
    elif kind == "flip":
        content = _damage(content, kind, at, byte=draw(st.integers(0, 255)))
    else:
        content = _damage(content, kind, at, inserted=draw(st.binary(min_size=1, max_size=16)))
    return Example(name, content, f"{mutation}; {kind} at byte {at}")


def _alias_bomb() -> bytes:
    return ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9))).encode()


PATHOLOGICAL = (
    Example("deep.json", b"[" * 200_000 + b"]" * 200_000, "200,000-deep JSON"),
    Example("deep.yaml", b"a: " + b"[" * 50_000 + b"]" * 50_000, "50,000-deep YAML"),
    Example("bomb.yaml", _alias_bomb(), "YAML alias bomb"),
    Example("huge.json", b'{"model": {"num_layers": 1' + b"0" * 100_000 + b"}}", "100,000-digit number"),
    Example("big.yaml", b"# " + b"x" * (1 << 20) + b"\n", "1 MiB file"),
    Example("binary.yaml", bytes(range(256)) * 8, "binary garbage"),
    Example("nul.json", b"\x00" * 64, "NUL bytes"),
    Example("empty.yaml", b"", "empty file"),
    Example("list.json", b"[1, 2, 3]", "a list at the top level"),
    Example("utf16.json", json.dumps(PLAN).encode("utf-16"), "UTF-16"),
)


# each damage at the middle of each base file, unmutated: the fixed examples the property test always runs
DAMAGED = tuple(Example(name, _damage(content, kind, len(content) // 2), f"{kind} in the middle")
                for name, content in ((name, _serialise(name, base)) for name, base in BASES) for kind in DAMAGES)


@st.composite
def _mutated(draw) -> Example:
    name, document, mutation = draw(_mutated_document())
    return Example(name, _serialise(name, document), mutation)


examples = st.one_of(_mutated(), _mutated(), _mutated(), _damaged(), st.sampled_from(PATHOLOGICAL))


# -- outcomes -------------------------------------------------------------------------------------

def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


class _Slow(Exception):
    pass


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def expire(signum, frame):
        raise _Slow

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # CLEAN or what went wrong
    detail: str
    seconds: float


def outcome(example: Example, folder: Path, *, time_limit_s: int = TIME_LIMIT_S) -> Outcome:
    """Load and estimate ``example`` (written into ``folder``) as ``vtrain estimate`` does."""
    path = folder / example.name
    path.write_bytes(example.content)
    start = time.perf_counter()
    try:
        with _time_limit(time_limit_s):
            result = estimate(load_run_config(path))
            document = result.to_dict()
    except _Slow:
        return Outcome("slow", f"over {time_limit_s} s", time.perf_counter() - start)
    except VTrainError as exc:
        message = str(exc)
        kind = CLEAN if message and "\n" not in message else "multi-line error"
        return Outcome(kind, message, time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - what the fuzz is looking for
        return Outcome("exception", f"{type(exc).__name__}: {exc}"[:300], time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if not (_finite(document) and result.iteration_time_ms > 0):
        return Outcome("non-finite", json.dumps(document, default=str)[:300], seconds)
    return Outcome(CLEAN, "estimate", seconds)
