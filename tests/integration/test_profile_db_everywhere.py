"""Every estimate path reads the profile database the same way: ``vtrain estimate``, the Python
``estimate()`` (a run or a traced graph) and the search, each with the same default
(``$VTRAIN_PROFILE_DB``) and an explicit way to read none."""

import json
import os
import shutil

import pytest

import vtrain_plugin as vtrain
from tests.support.cpu_profile import TINY_PLAN
from vtrain_plugin.runs import load_run_config
from vtrain_plugin.planning.search import search
from vtrain_plugin.planning.space import SearchSpace


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.yaml"
    path.write_text(TINY_PLAN)
    return str(path)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, tiny_cpu_profile):
    """A profile database holding the tiny CPU plan's kernels, measured on this machine (the session's
    profile, copied)."""
    db = tmp_path_factory.mktemp("profiles") / "profiles.sqlite"
    shutil.copy(tiny_cpu_profile.db, db)
    return db


def _cli_ms(run_cli, plan, *args: str, env: dict | None = None) -> float:
    return json.loads(run_cli("estimate", plan, "--format", "json", *args, check=True, env=env).stdout)[
        "iteration_time_ms"]


def test_cli_and_python_api_read_the_same_database(plan, profiled, run_cli, monkeypatch):
    run = load_run_config(plan)
    analytical = vtrain.estimate(run, profile_db=False)
    measured = vtrain.estimate(run, profile_db=profiled)
    assert analytical.measured_fraction == 0 and measured.measured_fraction > 0.99
    assert measured.iteration_time_ms != analytical.iteration_time_ms
    assert _cli_ms(run_cli, plan, "--db", str(profiled)) == measured.iteration_time_ms
    assert _cli_ms(run_cli, plan, "--no-db", env={"VTRAIN_PROFILE_DB": str(profiled)}) == analytical.iteration_time_ms

    monkeypatch.setenv("VTRAIN_PROFILE_DB", str(profiled))  # the default lookup, in both
    assert vtrain.estimate(run).iteration_time_ms == measured.iteration_time_ms
    assert _cli_ms(run_cli, plan, env={"VTRAIN_PROFILE_DB": str(profiled)}) == measured.iteration_time_ms
    graph = vtrain.trace(run.model, run.parallel)
    assert vtrain.estimate(graph, cluster=run.cluster, training=run.training).iteration_time_ms == \
        measured.iteration_time_ms


def test_search_reads_the_database_too(plan, profiled):
    run = load_run_config(plan)
    common = dict(cluster=run.cluster, global_batch_size=run.training.global_batch_size, gpus=1, workers=1,
                  space=SearchSpace(micro_batch_size=(run.parallel.micro_batch_size,), recompute=("none",),
                                    grad_reduce=(run.training.grad_reduce,)))
    with_db = search(run.model, profile_db=str(profiled), **common).table
    without = search(run.model, profile_db=False, **common).table
    assert with_db["iteration_time_ms"].tolist() == [vtrain.estimate(run, profile_db=profiled).iteration_time_ms]
    assert without["iteration_time_ms"].tolist() == [vtrain.estimate(run, profile_db=False).iteration_time_ms]
    assert os.environ["VTRAIN_PROFILE_DB"] != str(profiled)  # the tests' own default: no database
