"""``vtrain cluster-sim`` end to end: the real CLI on a small generated mix (GPT-3 1.3B on two
DGX A100 nodes), its job file, its curve cache and its Gantt charts; a bad job file is one line."""

import json

import pytest

from vtrain_plugin.cli import main
from vtrain_plugin.planning.cluster.jobs import read_jobs
from vtrain_plugin.planning.cluster.report import SUMMARY_COLUMNS

CLUSTER = ["--gpu", "A100", "--nodes", "2"]
POLICIES = ["edf-linear", "edf-vtrain", "fifo-static"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory, python_m):
    out = tmp_path_factory.mktemp("cluster-sim")
    args = ["cluster-sim", "--generate", "12", "--seed", "3", *CLUSTER, "--models", "gpt3-1.3b", "--policy", "all",
            "--format", "json", "--write-jobs", str(out / "jobs.yaml"), "--gantt", str(out / "gantt.png"),
            "--cache-dir", str(out / "cache")]
    proc = python_m("vtrain_plugin.cli", *args, fresh=True)  # vtrain cluster-sim in a plain subprocess
    assert proc.returncode == 0, proc.stderr
    return out, json.loads(proc.stdout)


def test_every_policy_is_reported_with_its_summary(generated):
    _, report = generated
    assert report["cluster"] == {"gpu": "a100-sxm4-80gb", "nodes": 2, "gpus_per_node": 8, "total_gpus": 16,
                                 "granularity": "node", "price_per_gpu_hour_usd": 2.0}
    assert report["restart_s"] == 120.0
    assert [p["policy"] for p in report["policies"]] == POLICIES
    for policy in report["policies"]:
        assert set(SUMMARY_COLUMNS) <= set(policy)
        assert policy["jobs"] == 12 and len(policy["outcomes"]) == 12
        assert 0 < policy["utilization"] <= 1
        met = sum(o["met_deadline"] for o in policy["outcomes"])
        assert policy["deadline_satisfaction"] == met / 12
        assert policy["cost_usd"] == pytest.approx(2.0 * policy["gpu_hours"])
    fifo = report["policies"][2]
    assert fifo["rejected"] == 0 and all(o["resizes"] == 0 for o in fifo["outcomes"])


def test_the_written_job_file_the_cache_and_the_gantt_charts(generated):
    out, _ = generated
    jobs = read_jobs(out / "jobs.yaml")
    assert [j.name for j in jobs] == [f"job-{i:02d}" for i in range(1, 13)]
    assert {j.model_ref for j in jobs} == {"gpt3-1.3b"} and {j.global_batch_size for j in jobs} <= {512, 1024}
    assert len(list((out / "cache" / "curves").glob("*.json"))) == len({j.global_batch_size for j in jobs})
    for policy in POLICIES:
        assert (out / f"gantt.{policy}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_job_file_reproduces_the_generated_run_from_the_warm_cache(generated, capsys):
    out, report = generated
    common = [*CLUSTER, "--cache-dir", str(out / "cache")]
    assert main(["cluster-sim", str(out / "jobs.yaml"), *common, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == report
    assert main(["cluster-sim", str(out / "jobs.yaml"), *common, "--policy", "edf-vtrain"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "12 jobs on 2 x 8 a100-sxm4-80gb (16 GPUs, allocated by node), restart cost 120 s"
    assert table[2].split() == ["policy", "jobs", "deadline_satisfaction", "rejected", "late", "mean_jct_hours",
                                "p95_jct_hours", "makespan_hours", "utilization", "gpu_hours", "cost_usd"]
    assert table[3].split()[:2] == ["edf-vtrain", "12"]


def test_a_bad_job_file_is_one_line_and_exit_2(run_cli, tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text("jobs:\n  - {name: late, submit_hours: 5, model: gpt3-1.3b, global_batch: 512, tokens: 1e9,"
                    " deadline_hours: 3}\n")
    proc = run_cli("cluster-sim", str(path), *CLUSTER)
    assert proc.returncode == 2
    assert proc.stderr == f"vtrain: error: {path}: job 'late': deadline_hours (3) must be after submit_hours (5)\n"
    assert proc.stdout == ""


def test_failures_on_are_reported_and_reproducible(generated, capsys):
    out, report = generated
    args = ["cluster-sim", str(out / "jobs.yaml"), *CLUSTER, "--cache-dir", str(out / "cache"), "--format", "json",
            "--failures", "typical", "--seed", "5"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert first["failures"] == {"failure_rate_per_gpu_hour": 1.5 / (384 * 168), "checkpoint": "sync", "seed": 5}
    assert report["failures"] is None
    for policy in first["policies"]:
        assert policy["failures"] == sum(o["failures"] for o in policy["outcomes"])
        assert policy["lost_gpu_hours"] == pytest.approx(sum(o["lost_gpu_hours"] for o in policy["outcomes"]))
