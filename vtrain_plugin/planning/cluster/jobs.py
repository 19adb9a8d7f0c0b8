"""Job files: the training jobs a cluster simulation runs, read from YAML, JSON or CSV and checked
one job at a time, so that an error names the file, the job and the field.

One job per row (CSV) or per entry of a top-level ``jobs`` list (YAML / JSON):

=====================  ==========================================================================
name                   unique name of the job
submit_hours           when it arrives, hours after the start of the simulation (>= 0)
model                  a preset name (``gpt3-13b``, see :data:`MODEL_PRESETS`), a plan file whose
                       ``model`` section is used (path relative to the job file), or, in YAML/JSON,
                       a ``model`` section itself
global_batch           sequences per iteration
tokens                 tokens to train on (the last global batch is a full one)
deadline_hours         absolute deadline, hours after the start; or instead
deadline_after_hours   the deadline relative to ``submit_hours``
priority               optional integer, larger first among equals (default 0)
gpus                   optional GPU count the job asks for (the ``fifo-static`` policy gives it)
=====================  ==========================================================================

Times are hours in files and seconds inside the simulation (``submit_s``, ``deadline_s``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vtrain_plugin.runs import load_model_file
from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.core.units import SECONDS_PER_HOUR
from vtrain_plugin.planning.model_family import model_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.plan_file import build_spec
from vtrain_plugin.specs.reading import read_mapping

FIELDS = ("name", "submit_hours", "model", "global_batch", "tokens", "deadline_hours", "deadline_after_hours",
          "priority", "gpus")
REQUIRED = ("name", "submit_hours", "model", "global_batch", "tokens")
PLAN_FILE_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One training job. ``model_ref`` is the preset name or plan-file path the file gave (None for
    a model section spelled out in the file)."""

    name: str
    submit_s: float
    model: ModelSpec
    model_ref: str | None = None
    global_batch_size: int
    tokens: float
    deadline_s: float
    priority: int = 0
    requested_gpus: int | None = None

    def __post_init__(self) -> None:
        where = f"job {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"job name must be a non-empty string, got {self.name!r}")
        if isinstance(self.submit_s, bool) or not isinstance(self.submit_s, (int, float)) or not (
                0 <= self.submit_s < math.inf):
            raise ConfigError(f"{where}: submit_hours must be a finite number >= 0, "
                              f"got {self.submit_s / SECONDS_PER_HOUR:g}")
        v.positive_int(f"{where}: global_batch", self.global_batch_size)
        v.positive_finite_number(f"{where}: tokens", self.tokens)
        if not (isinstance(self.deadline_s, (int, float)) and math.isfinite(self.deadline_s)):
            raise ConfigError(f"{where}: deadline_hours must be a finite number, got {self.deadline_s!r}")
        if self.deadline_s <= self.submit_s:
            raise ConfigError(f"{where}: deadline_hours ({self.deadline_s / SECONDS_PER_HOUR:g}) must be after "
                              f"submit_hours ({self.submit_s / SECONDS_PER_HOUR:g})")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"{where}: priority must be an integer, got {self.priority!r}")
        if self.requested_gpus is not None:
            v.positive_int(f"{where}: gpus", self.requested_gpus)

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.model.seq_length

    @property
    def iterations(self) -> int:
        """Iterations that train on ``tokens``, the last global batch a full one."""
        return math.ceil(self.tokens / self.tokens_per_iteration)


def read_jobs(path: str | Path) -> tuple[Job, ...]:
    """The jobs of a YAML / JSON (``jobs:`` list) or CSV file; errors are one line naming the file,
    the job and the field."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        entries = _csv_entries(path)
    elif suffix in PLAN_FILE_SUFFIXES:
        data = read_mapping(path)
        v.no_unknown_keys(str(path), data, ["jobs"])
        entries = data.get("jobs")
        if not isinstance(entries, list):
            raise ConfigError(f"{path}: 'jobs' must be a list of jobs, got {type(entries).__name__}")
    else:
        raise ConfigError(f"{path}: a job file is .yaml, .yml, .json or .csv, got {suffix or 'no suffix'!r}")
    if not entries:
        raise ConfigError(f"{path}: no jobs")
    jobs: list[Job] = []
    seen: set[str] = set()
    for number, entry in enumerate(entries, start=1):
        try:
            job = job_from_entry(entry, number=number, base_dir=path.parent)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if job.name in seen:
            raise ConfigError(f"{path}: job {job.name!r}: name is used by an earlier job")
        seen.add(job.name)
        jobs.append(job)
    return tuple(jobs)


def job_from_entry(entry: Any, *, number: int, base_dir: Path = Path(".")) -> Job:
    """One job of a file: ``entry`` maps the :data:`FIELDS` to values (CSV cells are text; an empty
    cell is a missing value). ``number`` names the job in errors when its name is missing."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"job #{number} must be a mapping of fields, got {type(entry).__name__}")
    entry = {key: value for key, value in entry.items() if value is not None and value != ""}
    name = str(entry.get("name", "")).strip()
    where = f"job {name!r}" if name else f"job #{number}"
    v.no_unknown_keys(where, entry, FIELDS)
    missing = next((key for key in REQUIRED if key not in entry), None)
    if missing is not None:
        raise ConfigError(f"{where}: missing field {missing!r}")
    deadlines = [key for key in ("deadline_hours", "deadline_after_hours") if key in entry]
    if len(deadlines) != 1:
        raise ConfigError(f"{where}: give exactly one of 'deadline_hours' (absolute) and 'deadline_after_hours' "
                          f"(after submit_hours), got {len(deadlines)}")
    submit_hours = _number(where, "submit_hours", entry["submit_hours"])
    deadline = _number(where, deadlines[0], entry[deadlines[0]])
    if deadlines[0] == "deadline_after_hours":
        if not deadline > 0:
            raise ConfigError(f"{where}: deadline_after_hours must be positive, got {deadline:g}")
        deadline += submit_hours
    model, ref = _model(where, entry["model"], base_dir)
    return Job(name=name, submit_s=submit_hours * SECONDS_PER_HOUR, model=model, model_ref=ref,
               global_batch_size=_integer(where, "global_batch", entry["global_batch"]),
               tokens=_number(where, "tokens", entry["tokens"]), deadline_s=deadline * SECONDS_PER_HOUR,
               priority=_integer(where, "priority", entry.get("priority", 0)),
               requested_gpus=_integer(where, "gpus", entry["gpus"]) if "gpus" in entry else None)


def write_jobs(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write job-file entries (mappings of :data:`FIELDS`; models by preset name or plan file) as a
    YAML / JSON or CSV file by the suffix, atomically."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        import pandas as pd  # here: a third of a second to load, and only CSV job files need it

        columns = [f for f in FIELDS if any(f in row for row in rows)]
        text = pd.DataFrame(rows, columns=columns, dtype=object).to_csv(index=False)
    elif suffix == ".json":
        text = json.dumps({"jobs": list(rows)}, indent=1) + "\n"
    elif suffix in PLAN_FILE_SUFFIXES:
        text = yaml.safe_dump({"jobs": [dict(row) for row in rows]}, sort_keys=False)
    else:
        raise ConfigError(f"{path}: a job file is .yaml, .yml, .json or .csv, got {suffix or 'no suffix'!r}")
    atomic_write_text(path, text)


def _csv_entries(path: Path) -> list[dict[str, str]]:
    import pandas as pd  # here: a third of a second to load, and only CSV job files need it

    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: malformed CSV: {str(exc).strip().splitlines()[0]}") from None
    return frame.to_dict(orient="records")


def _model(where: str, value: Any, base_dir: Path) -> tuple[ModelSpec, str | None]:
    if isinstance(value, Mapping):
        try:
            return build_spec(ModelSpec, "model", value), None
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: model must be a preset name, a plan file or a model section, got {value!r}")
    ref = value.strip()
    try:
        if Path(ref).suffix.lower() in PLAN_FILE_SUFFIXES:
            return load_model_file(base_dir / ref).model, ref
        return model_preset(ref), ref
    except ConfigError as exc:
        raise ConfigError(f"{where}: model: {exc}") from None


def _number(where: str, field: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where}: {field} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {field} must be a finite number, got {value!r}")
    return float(value)


def _integer(where: str, field: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"{where}: {field} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {field} must be an integer, got {value!r}")
    return value
