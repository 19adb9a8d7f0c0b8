"""``search()`` and ``vtrain search`` on a tiny traced GPT: the same numbers as estimating each plan alone."""

import json
import math
from dataclasses import replace

import pandas as pd
import pytest
import yaml

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.cli import main
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.evaluate import ESTIMATE_COLUMNS, PLAN_COLUMNS, evaluate_batch, make_batches
from vtrain_plugin.planning.pareto import pareto_front
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import GpuBudget, SearchSpace, enumerate_plans
from vtrain_plugin.planning.workers import WorkerTraceback, evaluate_in_workers
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.training import TrainingSpec

MODEL_SECTION = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                 "vocab_size": 1024}
MODEL = ModelSpec(**MODEL_SECTION)
CLUSTER = get_cluster_preset("dgx-a100")
# 2 TP x 2 PP, one micro-batch size, no SP or recompute: 4 trace shapes, 12 chunk traces; 10 layouts
# (with vp) x 2 gradient reductions, the 5 with dp > 1 also with the distributed optimizer: 30 plans
SPACE = SearchSpace(tensor_parallel=(1, 2), pipeline_parallel=(1, 2), micro_batch_size=(1,),
                    sequence_parallel=(False,), recompute=("none",))
PINNED = ["--tp", "1,2", "--pp", "1,2", "--micro-batch", "1", "--sp", "off", "--recompute", "none"]
GPUS, GLOBAL_BATCH = "2,4", 8
COLUMNS = {*PLAN_COLUMNS, *ESTIMATE_COLUMNS, "pareto", "rank"}


@pytest.fixture(scope="module")
def result():
    return search(MODEL, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus=GPUS, space=SPACE, workers=1)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL_SECTION, "training": {"global_batch_size": GLOBAL_BATCH},
                                    "cluster": {"preset": "dgx-a100"}}))
    return str(path)


def test_search_rows_are_the_estimates_of_the_same_plans_one_by_one(result):
    candidates = enumerate_plans(MODEL, SPACE, global_batch_size=GLOBAL_BATCH, budget=GpuBudget.parse(GPUS),
                                 training=TrainingSpec(global_batch_size=GLOBAL_BATCH), gpus_per_node=8).candidates
    table = result.table
    assert len(table) == len(candidates) == 30 and set(table.columns) == COLUMNS
    assert result.skipped == {}
    by_plan = table.set_index(["tensor_parallel", "pipeline_parallel", "data_parallel", "virtual_pipeline",
                               "grad_reduce", "distributed_optimizer"])
    assert by_plan.index.is_unique
    for c in candidates:
        p = c.parallel
        est = estimate(trace(MODEL, p), cluster=CLUSTER, training=c.training)
        row = by_plan.loc[(p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.virtual_pipeline,
                           c.training.grad_reduce.value, c.training.distributed_optimizer)]
        assert row["schedule"] == c.training.schedule.value
        for column in ("iteration_time_ms", "tokens_per_second", "tflops_per_gpu", "mfu", "peak_memory_gib",
                       "cost_usd", "num_gpus", "num_microbatches", "fits_in_memory"):
            assert row[column] == getattr(est, column), column
    assert table["rank"].tolist() == list(range(1, 31))
    assert table["iteration_time_ms"].is_monotonic_increasing  # every plan fits: ranked by time
    assert table["pareto"].tolist() == pareto_front(table["iteration_time_ms"], table["cost_usd"],
                                                    table["fits_in_memory"]).tolist()
    assert 1 <= len(result.front) < 30


def test_worker_processes_give_the_same_table(result):
    spawned = search(MODEL, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus=GPUS, space=SPACE, workers=2)
    pd.testing.assert_frame_equal(spawned.table, result.table, check_exact=True)


def test_ray_backend_gives_the_same_table(result):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install vtrain[ray])")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        on_ray = search(MODEL, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus=GPUS, space=SPACE,
                        backend="ray", workers=2)
    finally:
        ray.shutdown()
    pd.testing.assert_frame_equal(on_ray.table, result.table, check_exact=True)


def test_ray_backend_without_ray_is_a_one_line_error():
    try:
        import ray  # noqa: F401
        pytest.skip("ray is installed")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"^backend ray needs `pip install vtrain\[ray\]`$"):
        search(MODEL, cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, gpus=GPUS, space=SPACE, backend="ray")


def test_cli_jsonl_is_one_object_per_evaluated_plan_and_plot_is_a_png(tmp_path, run_cli, model_file, result):
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(yaml.safe_dump({
        "model": MODEL_SECTION, "parallel": {"pipeline_parallel": 2, "data_parallel": 2},
        "training": {"global_batch_size": 32}}))
    plot = tmp_path / "front.png"
    proc = run_cli("search", model_file, "--gpus", GPUS, *PINNED, "--format", "jsonl", "--plot", str(plot),
                   "--baseline", str(baseline), "--tokens", "1e9", "--workers", "1", check=True,
                   fresh=True)  # vtrain search in a plain subprocess
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 30
    for row, expected in zip(rows, result.table.to_dict(orient="records")):
        assert set(row) == COLUMNS | {"iterations", "train_days", "train_cost_usd", "expected_train_days",
                                      "expected_train_cost_usd", "goodput", "checkpoint_interval_iterations"}
        assert row["expected_train_days"] > row["train_days"] and 0 < row["goodput"] < 1
        assert {k: row[k] for k in expected} == expected
        # Estimate's arithmetic: whole iterations of 8 sequences of 128 tokens, rounded up
        assert row["iterations"] == math.ceil(1e9 / (8 * 128))
        assert row["train_days"] == pytest.approx(row["iterations"] * row["iteration_time_ms"] / 1000 / 86400,
                                                  rel=1e-12)
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_cli_table_csv_and_output_file(tmp_path, model_file, capsys, result):
    assert main(["search", model_file, "--gpus", GPUS, *PINNED, "--top", "3", "--workers", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["rank", "tp", "cp", "pp", "dp"] and len(lines) == 2 + 3 + 2
    assert lines[-1] == ("30 plans evaluated, 30 fit in memory, "
                         f"{int(result.table['pareto'].sum())} on the Pareto front (*), ranked by time; skipped 0")
    out = tmp_path / "plans.csv"
    assert main(["search", model_file, "--gpus", "2:4", *PINNED, "--format", "csv", "--output", str(out),
                 "--objective", "cost", "--workers", "1", "--dp", "1,2,3"]) == 0
    assert capsys.readouterr().out == ""
    csv = pd.read_csv(out)
    # 6 layouts in 2 to 4 GPUs (tp 1 pp 1 dp 3 is 3 GPUs but does not divide the global batch of 8),
    # 3 of them pp 2 with vp 1 or 2: 9 x 2 gradient reductions; the 3 with dp 2 (tp 1 pp 1, tp 2
    # pp 1, tp 1 pp 2 with vp 1 or 2) also with the distributed optimizer: 18 + 4 x 2
    assert len(csv) == 26 and csv["cost_usd"].is_monotonic_increasing and csv["rank"].tolist() == list(range(1, 27))


def test_cli_bad_input_is_one_line_and_exit_2(run_cli, model_file):
    proc = run_cli("search", model_file, "--gpus", "8", "--tp", "3,5")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "vtrain: error: no valid plan: 2 skipped (heads % tp: 2)\n"


@pytest.mark.parametrize("args,message", [
    (["--gpus", "1", "--tp", "2"], "no valid plan: 3 skipped (gpus not in budget: 3)"),  # tp 2 x pp 1, 2, 4
    (["--gpus", "8", "--objective", "fast"], "--objective must be one of time, days, cost; got 'fast'"),
    (["--gpus", "8", "--tokens=-2e9"], "--tokens must be a positive number, got '-2e9'"),
    (["--gpus", "8", "--tp", "4,x"], "--tp: 'x' is not a positive integer"),
    (["--gpus", "8", "--sp", "yes"], "--sp: 'yes' is not on or off"),
    (["--gpus", "8", "--recompute", "most"], "--recompute: 'most' is not one of none, selective, full"),
    (["--gpus", "1024:"],
     "--gpus: '1024:' is not a GPU count (3360), a range LOW:HIGH (1024:4096) or a list (2240,2800,3360)"),
    ([], "--gpus is required: a count (3360), a range (1024:4096) or a list (2240,2800,3360)"),
    (["--gpus", "8", "--global-batch", "0"], "--global-batch must be a positive integer, got '0'"),
    (["--gpus", "8", "--backend", "spark"], "--backend must be one of local, ray; got 'spark'"),
])
def test_cli_bad_input_names_the_flag_and_rule(capsys, model_file, args, message):
    assert main(["search", model_file, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"vtrain: error: {message}\n"


def test_a_model_file_without_training_needs_the_global_batch(tmp_path, capsys):
    path = tmp_path / "model_only.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL_SECTION}))
    assert main(["search", str(path), "--gpus", "8"]) == 2
    assert capsys.readouterr().err == f"vtrain: error: --global-batch is required: {path} has no training section\n"


def test_a_workers_error_is_raised_in_the_caller_with_the_workers_traceback():
    cluster = replace(CLUSTER, gpu="no-such-gpu")
    enumeration = enumerate_plans(MODEL, SPACE, global_batch_size=GLOBAL_BATCH, budget=GpuBudget.of(GPUS),
                                  training=TrainingSpec(global_batch_size=GLOBAL_BATCH), gpus_per_node=8)
    batches = make_batches(MODEL, cluster, enumeration.candidates)
    with pytest.raises(ConfigError) as in_process:
        evaluate_batch(batches[0])
    with pytest.raises(ConfigError) as in_workers:
        evaluate_in_workers(batches, 2, on_plans=lambda n: None)
    assert str(in_workers.value) == str(in_process.value)
    assert isinstance(in_workers.value.__cause__, WorkerTraceback)
    assert "in evaluate_batch" in str(in_workers.value.__cause__)


def test_search_says_how_many_plans_each_constraint_removed(run_cli, model_file):
    # --sp on with --tp 1,2: the TP 1 plan breaks "sp needs tp > 1" and the footer says so, one line
    proc = run_cli("search", model_file, "--gpus", "2", "--tp", "1,2", "--pp", "1", "--micro-batch", "1",
                   "--sp", "on", "--recompute", "none", "--grad-reduce", "overlap", check=True)
    footer = proc.stdout.strip().splitlines()[-1]
    assert footer.endswith("skipped 1 (sp needs tp > 1: 1)"), footer
    # only TP 1: no plan, and the one-line error names the constraint
    proc = run_cli("search", model_file, "--gpus", "1", "--tp", "1", "--pp", "1", "--micro-batch", "1",
                   "--sp", "on", "--recompute", "none", "--grad-reduce", "overlap")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "vtrain: error: no valid plan: 1 skipped (sp needs tp > 1: 1)"]
