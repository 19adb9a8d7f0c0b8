"""Throughput curves: the best plan at every GPU count from vtrain's search (a real tiny GPT,
traced once), the curve cache on disk, and the arithmetic of hand-made curves."""

import json
import logging

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.cluster.cluster_config import ClusterConfig
from vtrain_plugin.planning.cluster.curve_cache import CurveCache, curve_inputs, job_curves
from vtrain_plugin.planning.cluster.curves import CurveSpace, ThroughputCurve, compute_curve
from vtrain_plugin.planning.cluster.jobs import Job
from vtrain_plugin.planning.model_family import model_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

TINY = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1024, name="tiny")
CLUSTER = ClusterConfig(spec=get_cluster_preset("dgx-a100"), nodes=2, granularity="gpu")
SPACE = CurveSpace()


@pytest.fixture(scope="module")
def curve():
    return compute_curve(TINY, 16, CLUSTER, SPACE)


def test_a_curve_is_the_estimate_of_the_fastest_fitting_plan_at_each_count(curve):
    # TP 1 fits (the automatic choice), 2 layers make one pipeline stage, DP must divide the batch of 16.
    assert curve.counts == (1, 2, 4, 8, 16)
    for point in curve.points:
        assert (point.tensor_parallel, point.pipeline_parallel, point.data_parallel) == (1, 1, point.gpus)
        plan = ParallelPlan(tensor_parallel=1, pipeline_parallel=1, data_parallel=point.gpus, micro_batch_size=1,
                            recompute="full")
        est = estimate(trace(TINY, plan), cluster=CLUSTER.spec,
                       training=TrainingSpec(global_batch_size=16, grad_reduce="overlap"))
        assert point.iteration_time_ms == est.iteration_time_ms
        assert point.mfu == est.mfu
    assert curve.iteration_s(4) == curve.points[2].iteration_time_ms / 1000


def test_a_model_with_no_valid_plan_gets_a_curve_with_the_reason():
    odd = ModelSpec(num_layers=2, hidden_size=192, num_attention_heads=3, seq_length=128, vocab_size=1024)
    nowhere = compute_curve(odd, 16, CLUSTER, CurveSpace(tensor_parallel=(2,)))
    assert not nowhere.fits
    assert nowhere.reason.startswith("no plan fits on 1 to 16 GPUs (micro-batch 1, full recompute; TP 2: no valid "
                                     "plan: ")
    assert "heads % tp" in nowhere.reason


def test_the_cache_keeps_curves_on_disk_and_rebuilds_a_corrupt_entry(tmp_path, curve, caplog):
    cache = CurveCache(tmp_path)
    assert cache.curve(TINY, 16, CLUSTER, SPACE) == curve and cache.computed == 1
    assert cache.curve(TINY, 16, CLUSTER, SPACE) == curve and cache.computed == 1  # in memory
    (entry,) = (tmp_path / "curves").iterdir()
    again = CurveCache(tmp_path)
    assert again.curve(TINY, 16, CLUSTER, SPACE) == curve and again.computed == 0  # from disk
    eight = again.curve(TINY, 8, CLUSTER, SPACE)  # another key; on 16 GPUs DP 16 > 8 sequences: TP 2 there
    assert [(p.gpus, p.tensor_parallel) for p in eight.points] == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 2)]
    assert again.computed == 1
    assert len(list((tmp_path / "curves").iterdir())) == 2
    entry.write_text('{"inputs": ')
    with caplog.at_level(logging.WARNING):
        rebuilt = CurveCache(tmp_path)
        assert rebuilt.curve(TINY, 16, CLUSTER, SPACE) == curve and rebuilt.computed == 1
    assert "ignoring the unreadable curve cache entry" in caplog.text
    stored = json.loads(entry.read_text())
    assert stored["curve"] == curve.to_dict()
    assert stored["inputs"] == json.loads(json.dumps(curve_inputs(TINY, 16, CLUSTER, SPACE)))
    assert set(stored["inputs"]) == {"format", "vtrain", "model", "global_batch_size", "node", "counts", "space",
                                     "calibration", "code", "profiles"}
    data = json.loads(entry.read_text())
    data["inputs"]["global_batch_size"] = 8  # a file under the wrong key
    entry.write_text(json.dumps(data))
    checked = CurveCache(tmp_path)
    checked.curve(TINY, 16, CLUSTER, SPACE)
    assert checked.computed == 1


def test_jobs_with_one_model_and_batch_share_a_curve(tmp_path, curve):
    jobs = [Job(name=name, submit_s=0, model=TINY, global_batch_size=16, tokens=1e6, deadline_s=10)
            for name in ("a", "b")]
    cache = CurveCache(None)
    curves = job_curves(jobs, CLUSTER, SPACE, cache)
    assert curves == {"a": curve, "b": curve} and cache.computed == 1
    assert not (tmp_path / "curves").exists()


def test_the_cache_folder_and_switch_are_the_trace_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VTRAIN_NO_CACHE", raising=False)
    assert CurveCache.from_environment().directory == tmp_path / "curves"
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")
    assert CurveCache.from_environment().directory is None


def test_hand_made_curves():
    curve = ThroughputCurve.from_seconds({8: 10.0, 16: 6.0, 24: 6.5, 32: 4.0})
    assert curve.counts == (8, 16, 24, 32) and curve.min_gpus == 8 and curve.fits
    assert curve.efficient_counts() == (8, 16, 32)  # 24 is slower than 16
    assert ThroughputCurve.from_dict(json.loads(json.dumps(curve.to_dict()))) == curve
    with pytest.raises(ValueError, match="ascending"):
        ThroughputCurve(points=curve.points[::-1])
    with pytest.raises(ValueError, match="needs the reason"):
        ThroughputCurve()


def test_a_model_whose_states_overflow_every_plan_is_rejected_without_tracing():
    # GPT-3 175B on one node: 174.6e9 parameters x 16 bytes / 8 GPUs = 349 GB per GPU at best.
    one_node = ClusterConfig(spec=get_cluster_preset("dgx-a100"), nodes=1)
    curve = compute_curve(model_preset("gpt3-175b"), 512, one_node, SPACE)
    assert not curve.fits
    assert curve.reason == ("no plan fits on 8 to 8 GPUs (micro-batch 1, full recompute; "
                            + "; ".join(f"TP {t}: the model states alone overflow a GPU in every valid plan"
                                        for t in (1, 2, 4, 8)) + ")")


def test_a_curve_is_keyed_on_the_profile_database_its_estimates_read(tmp_path, monkeypatch):
    """Estimates read the profile database, so a curve cached before ``vtrain profile`` filled it
    is not one of after."""
    db = tmp_path / "profiles.sqlite"
    monkeypatch.setenv("VTRAIN_PROFILE_DB", str(db))
    assert curve_inputs(TINY, 16, CLUSTER, SPACE)["profiles"] is None
    db.write_bytes(b"x" * 10)
    stamp = curve_inputs(TINY, 16, CLUSTER, SPACE)["profiles"]
    assert stamp == {"path": str(db.resolve()), "nbytes": 10, "mtime_ns": db.stat().st_mtime_ns}
