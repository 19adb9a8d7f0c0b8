"""Job files (YAML, JSON, CSV) and the synthetic mix: what is read, and one-line errors that name
the job and the field (exit code 2 from the CLI)."""

import json

import pytest

from tests.conftest import REPO
from vtrain_plugin.cli import main
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curves import ThroughputCurve
from vtrain_plugin.planning.cluster.generator import MixSpec, generate_jobs
from vtrain_plugin.planning.cluster.jobs import read_jobs, write_jobs
from vtrain_plugin.planning.model_family import MODEL_PRESETS, model_preset

HOUR = 3600.0

YAML_JOBS = """\
jobs:
  - name: pretrain
    submit_hours: 0.5
    model: llama2-7b
    global_batch: 256
    tokens: 2e9
    deadline_hours: 30
    priority: 2
    gpus: 64
  - name: tiny
    submit_hours: 1
    model: {PLAN}
    global_batch: 8
    tokens: 1000
    deadline_after_hours: 2
  - name: spelled-out
    submit_hours: 0
    model: {{num_layers: 2, hidden_size: 256, num_attention_heads: 4, seq_length: 128}}
    global_batch: 4
    tokens: 512
    deadline_hours: 1
"""


def test_yaml_jobs_with_a_preset_a_plan_file_and_a_model_section(tmp_path):
    plan = REPO / "examples" / "plans" / "gpt_tiny_cpu.yaml"
    (tmp_path / "jobs.yaml").write_text(YAML_JOBS.format(PLAN=plan))
    pretrain, tiny, spelled = read_jobs(tmp_path / "jobs.yaml")
    assert pretrain.model == MODEL_PRESETS["llama2-7b"] and pretrain.model_ref == "llama2-7b"
    assert (pretrain.submit_s, pretrain.deadline_s, pretrain.priority, pretrain.requested_gpus) == (1800, 108000, 2, 64)
    assert pretrain.iterations == 1908  # 2e9 / (256 x 4096) = 1907.3, the last batch a full one
    assert tiny.model.name == "gpt-tiny" and tiny.model.hidden_size == 512
    assert (tiny.submit_s, tiny.deadline_s) == (HOUR, 3 * HOUR)  # 2 h after its submission
    assert tiny.iterations == 1 and tiny.requested_gpus is None and tiny.priority == 0
    assert spelled.model.num_layers == 2 and spelled.model_ref is None


def test_csv_jobs_read_like_yaml_and_round_trip(tmp_path):
    rows = [{"name": "a", "submit_hours": 0.0, "model": "gpt3-1.3b", "global_batch": 512, "tokens": 1073741824,
             "deadline_hours": 3.5, "gpus": 16},
            {"name": "b", "submit_hours": 0.25, "model": "gpt3-13b", "global_batch": 1024, "tokens": 2147483648,
             "deadline_hours": 9.75}]
    for suffix in (".csv", ".yaml", ".json"):
        write_jobs(tmp_path / f"jobs{suffix}", rows)
    csv, yaml, js = (read_jobs(tmp_path / f"jobs{suffix}") for suffix in (".csv", ".yaml", ".json"))
    assert csv == yaml == js
    assert [j.requested_gpus for j in csv] == [16, None] and csv[1].deadline_s == 9.75 * HOUR
    assert (tmp_path / "jobs.csv").read_text().splitlines()[0] == \
        "name,submit_hours,model,global_batch,tokens,deadline_hours,gpus"


GOOD = {"name": "j1", "submit_hours": 2, "model": "gpt3-1.3b", "global_batch": 512, "tokens": 1e9,
        "deadline_hours": 10}


@pytest.mark.parametrize("change, message", [
    ({"tokens": None}, "job 'j1': missing field 'tokens'"),
    ({"name": None}, "job #1: missing field 'name'"),
    ({"tokens": -5}, "job 'j1': tokens must be positive and finite, got -5.0"),
    ({"deadline_hours": 1.5}, "job 'j1': deadline_hours (1.5) must be after submit_hours (2)"),
    ({"deadline_hours": None, "deadline_after_hours": -1}, "job 'j1': deadline_after_hours must be positive, got -1"),
    ({"deadline_hours": None}, "job 'j1': give exactly one of 'deadline_hours' (absolute) and "
                               "'deadline_after_hours' (after submit_hours), got 0"),
    ({"model": "gpt5"}, "job 'j1': model: unknown model preset 'gpt5'; valid presets are gpt3-1.3b, gpt3-2.7b, "
                        "gpt3-6.7b, gpt3-13b, gpt3-175b, llama2-7b, llama2-13b, llama2-70b"),
    ({"model": "missing.yaml"}, "job 'j1': model: "),
    ({"global_batch": 0}, "job 'j1': global_batch must be positive, got 0"),
    ({"global_batch": "many"}, "job 'j1': global_batch must be an integer, got 'many'"),
    ({"submit_hours": -1}, "job 'j1': submit_hours must be a finite number >= 0, got -1"),
    ({"gpus": 0}, "job 'j1': gpus must be positive, got 0"),
    ({"colour": "red"}, "job 'j1': unknown key 'colour'"),
])
@pytest.mark.parametrize("suffix", [".yaml", ".csv"])
def test_a_bad_job_is_one_line_naming_the_file_the_job_and_the_field(tmp_path, change, message, suffix):
    row = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = tmp_path / f"jobs{suffix}"
    if suffix == ".csv":
        header = list(row)
        path.write_text(",".join(header) + "\n" + ",".join(str(row[k]) for k in header) + "\n")
    else:
        path.write_text(json.dumps({"jobs": [row]}))  # JSON is YAML
    with pytest.raises(ConfigError) as error:
        read_jobs(path)
    text = str(error.value)
    assert text.startswith(f"{path}: {message}") and "\n" not in text


def test_file_level_errors(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text("jobs:\n  - " + json.dumps(GOOD) + "\n  - " + json.dumps(GOOD) + "\n")
    with pytest.raises(ConfigError, match="job 'j1': name is used by an earlier job"):
        read_jobs(path)
    path.write_text("jobs: []\n")
    with pytest.raises(ConfigError, match="jobs.yaml: no jobs"):
        read_jobs(path)
    with pytest.raises(ConfigError, match="a job file is .yaml, .yml, .json or .csv, got '.txt'"):
        read_jobs(tmp_path / "jobs.txt")


def test_the_cli_turns_a_bad_job_file_into_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "jobs.csv"
    path.write_text("name,submit_hours,model,global_batch,tokens,deadline_hours\nj1,2,gpt3-1.3b,512,-1e9,10\n")
    code = main(["cluster-sim", str(path), "--gpu", "A100", "--nodes", "2", "--no-cache"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"vtrain: error: {path}: job 'j1': tokens must be positive and finite, got -1000000000.0\n"


def flat_curves(model, batch):
    return ThroughputCurve.from_seconds({8 * k: model.num_parameters * batch / 1e14 / k for k in range(1, 17)})


def test_the_generator_is_reproducible_and_keeps_its_rules():
    cluster = ClusterConfig(spec=get_cluster_preset("dgx-a100"), nodes=16)
    mix = MixSpec(jobs=50, seed=7, slack=(1.2, 1.2), restart_s=120)
    rows = generate_jobs(mix, cluster, flat_curves)
    assert rows == generate_jobs(mix, cluster, flat_curves)
    assert rows != generate_jobs(MixSpec(jobs=50, seed=8), cluster, flat_curves)
    assert rows[0]["submit_hours"] == 0 and [r["name"] for r in rows[:2]] == ["job-01", "job-02"]
    submits = [r["submit_hours"] for r in rows]
    assert submits == sorted(submits)
    for row in rows:
        model = model_preset(row["model"])
        assert row["global_batch"] in (2**20 // model.seq_length, 2**21 // model.seq_length)
        curve = flat_curves(model, row["global_batch"])
        assert row["gpus"] in (8, 16, 32, 64)  # the smallest count (8) times 1, 2, 4 or 8
        iterations = row["tokens"] / (row["global_batch"] * model.seq_length)
        assert iterations == int(iterations)
        ideal_h = (120 + iterations * curve.iteration_s(row["gpus"])) / HOUR
        assert row["deadline_hours"] == pytest.approx(row["submit_hours"] + 1.2 * ideal_h, abs=1e-4)
    assert {r["model"] for r in rows} <= set(MixSpec(jobs=1, seed=0).models)


def test_the_generator_leaves_out_models_that_fit_nowhere():
    cluster = ClusterConfig(spec=get_cluster_preset("dgx-a100"), nodes=1)

    def small_only(model, batch):
        if model.num_parameters > 2e9:
            return ThroughputCurve(reason="too big")
        return flat_curves(model, batch)
    assert {r["model"] for r in generate_jobs(MixSpec(jobs=20, seed=1), cluster, small_only)} == {"gpt3-1.3b"}
    with pytest.raises(ConfigError, match="no model of the mix fits on 1 x 8 a100-sxm4-80gb .* gpt3-175b: too big"):
        generate_jobs(MixSpec(jobs=5, seed=1, models=("gpt3-175b",)), cluster, small_only)


@pytest.mark.parametrize("kwargs, message", [
    ({"slack": (0.9, 2.0)}, "slack must be at least 1"),
    ({"slack": (2.0, 1.5)}, "slack: the range 2:1.5 is empty"),
    ({"models": ("gpt5",)}, "unknown model preset 'gpt5'"),
    ({"load": 0}, "load must be positive"),
])
def test_mix_spec_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MixSpec(jobs=5, seed=1, **kwargs)
