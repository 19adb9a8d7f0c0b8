"""``vtrain estimate`` shows the whole plan it read: every line of the table's plan header, and every
field of ModelSpec, ParallelPlan and TrainingSpec in json, jsonl and csv (the field lists come from
the dataclasses, so a field added later cannot be left out)."""

import csv
import io
import json
from dataclasses import fields

import pytest

from tests.integration.test_te_fp8_cli import PLAN, write
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

FULL = {**PLAN, "parallel": {**PLAN["parallel"], "virtual_pipeline": 2, "recompute": "selective"},
        "training": {**PLAN["training"], "schedule": "interleaved_1f1b", "grad_reduce": "overlap", "distributed_optimizer": True,
                     "bucket_size_mb": 20, "fp8_param_gather": True, "grad_reduce_in_bf16": True,
                     "cross_entropy_fusion": True}}
SECTIONS = {"model": ModelSpec, "parallel": ParallelPlan, "training": TrainingSpec}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return write(tmp_path_factory.mktemp("plan"), "full.yaml", FULL)


def test_the_table_prints_the_whole_plan(plan, run_cli):
    head = run_cli("estimate", plan, "--no-db", check=True).stdout.splitlines()[:5]
    assert head == [
        f"{plan}: llama-tiny on 8 x h100-sxm",
        "  model     llama, 4 layers, hidden 256, 8 heads, 4 query groups (GQA), FFN 768, sequence 128, "
        "vocabulary 1024, bf16 with fp8 hybrid GEMMs",
        "  parallel  tp=2 cp=1 pp=2 vp=2 dp=2 ep=1, sequence parallel on, recompute selective",
        "  batch     micro-batch 1, global batch 8, 4 micro-batches per replica, schedule interleaved_1f1b",
        "  training  gradient reduction overlap (buckets 20 MB, gradients in bf16), distributed optimizer on, TP comm "
        "overlap off, stack megatron_core_te, fp8 hybrid (delayed scaling, FP8 weights)",
    ]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_json_carries_every_plan_field(plan, run_cli, fmt):
    document = json.loads(run_cli("estimate", plan, "--no-db", "--format", fmt, check=True).stdout)
    run = load_run_config(plan)
    for section, spec in SECTIONS.items():
        names = [f.name for f in fields(spec) if f.name != "reliability"]  # a section of its own, as in a plan file
        assert list(document["plan"][section]) == names
        written = json.loads(json.dumps(getattr(run, section).to_dict()))
        assert document["plan"][section] == {k: v for k, v in written.items() if k in names}
    assert document["plan"]["reliability"] == json.loads(json.dumps(run.training.to_dict()))["reliability"]
    assert document["plan"]["parallel"]["virtual_pipeline"] == 2
    assert document["plan"]["training"]["distributed_optimizer"] is True
    assert document["plan"]["cluster"]["gpu"] == "h100-sxm"


def test_csv_carries_every_plan_field(plan, run_cli):
    [row] = list(csv.DictReader(io.StringIO(run_cli("estimate", plan, "--no-db", "--format", "csv",
                                                    check=True).stdout)))
    for section, spec in SECTIONS.items():
        for f in fields(spec):
            name = "reliability" if f.name == "reliability" else f"{section}.{f.name}"
            assert any(column == name or column.startswith(f"{name}.") for column in row), name
    assert (row["parallel.virtual_pipeline"], row["model.num_query_groups"], row["training.grad_reduce"],
            row["reliability.failures"]) == ("2", "4", "overlap", "large-scale")


def test_the_json_plan_is_a_plan_file_that_estimates_the_same(plan, run_cli, tmp_path):
    first = json.loads(run_cli("estimate", plan, "--no-db", "--format", "json", check=True).stdout)
    again = tmp_path / "again.json"
    again.write_text(json.dumps(first["plan"]))
    second = json.loads(run_cli("estimate", str(again), "--no-db", "--format", "json", check=True).stdout)
    assert second["plan"] == first["plan"]
    for key in ("iteration_time_ms", "peak_memory_gib", "breakdown_ms", "expected_train_days"):
        assert second[key] == first[key], key
