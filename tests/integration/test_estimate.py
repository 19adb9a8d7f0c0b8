"""End-to-end estimates of real traced models, through the Python API and the real CLI."""

import json
import math

import pytest

from vtrain_plugin.runs import load_run_config, run_config_from_dict
from vtrain_plugin.estimate import estimate
from vtrain_plugin.sim.engine import BREAKDOWN_FIELDS

from tests.integration.test_cli_trace import SMALL, write

GPT3_CONFIG = "examples/configs/gpt3_175b_512gpu.json"


@pytest.fixture(scope="module")
def gpt3_estimate():
    return estimate(load_run_config(GPT3_CONFIG), timeline=True)


def test_gpt3_175b_breakdown_is_finite_and_sums_to_the_iteration(gpt3_estimate):
    e = gpt3_estimate
    assert e.num_gpus == 512 and e.num_microbatches == 1536 // 4
    assert set(e.breakdown_ms) == set(BREAKDOWN_FIELDS)
    assert all(math.isfinite(v) and v >= 0 for v in e.breakdown_ms.values())
    for stage in e.stage_breakdown_ms:
        assert sum(stage.values()) == pytest.approx(e.iteration_time_ms, rel=1e-9)
    compute = e.breakdown_ms["forward"] + e.breakdown_ms["backward"] + e.breakdown_ms["recompute"]
    assert compute / e.iteration_time_ms > 0.6
    assert 0 < e.mfu < 1 and e.tflops_per_gpu > 0
    assert e.tokens_per_second == pytest.approx(1536 * 2048 / (e.iteration_time_ms / 1000))


def test_gpt3_175b_bubble_share_matches_the_1f1b_formula(gpt3_estimate):
    p, m = 16, 384
    e = gpt3_estimate
    bubble_share = e.breakdown_ms["bubble"] / e.iteration_time_ms
    assert bubble_share == pytest.approx((p - 1) / (m + p - 1), rel=0.05)


def test_timeline_export_is_chrome_trace(tmp_path, gpt3_estimate):
    path = tmp_path / "timeline.json"
    gpt3_estimate.write_timeline(path, max_ranks=3, max_microbatches=4)
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 8, 15} or len({e["pid"] for e in complete}) == 3
    assert all(e["dur"] >= 0 for e in complete)


def test_more_gpus_per_replica_shortens_the_iteration():
    # large enough that the GPUs, not the host issuing their kernels, bound the iteration
    base = {**SMALL, "global_batch_size": 32, "hidden_size": 2048, "num_attention_heads": 16, "max_length": 1024}
    slow = estimate(run_config_from_dict({**base, "tensor_parallel_size": 1, "num_gpus": 4}))
    fast = estimate(run_config_from_dict(base))
    assert fast.iteration_time_ms < slow.iteration_time_ms


def test_cli_jsonl_one_line_per_config_and_errors_inline(tmp_path, run_cli):
    good = write(tmp_path, "good.json", SMALL)
    bad = write(tmp_path, "bad.json", {**SMALL, "global_batch_size": 6})
    proc = run_cli("estimate", good, bad, good, "--format", "jsonl")
    assert proc.returncode == 2
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["config"] for line in lines] == [good, bad, good]
    assert lines[1]["error"].endswith(
        "global_batch_size (6) must be divisible by data_parallel_size (2) * micro_batch_size (2) = 4")
    for line in (lines[0], lines[2]):
        assert {"iteration_time_ms", "breakdown_ms", "tflops_per_gpu", "mfu", "num_gpus"} <= line.keys()
        assert line["num_gpus"] == 8 and line["iteration_time_ms"] > 0
    assert lines[0]["iteration_time_ms"] == lines[2]["iteration_time_ms"]


def test_cli_jsonl_keeps_going_past_garbage_files(tmp_path, run_cli):
    good = write(tmp_path, "good.json", SMALL)
    garbage = tmp_path / "garbage.yaml"
    garbage.write_bytes(bytes(range(256)) * 4)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    proc = run_cli("estimate", str(garbage), good, str(deep), "--format", "jsonl")
    assert proc.returncode == 2 and proc.stderr == ""
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["config"] for line in lines] == [str(garbage), good, str(deep)]
    assert lines[0]["error"].startswith(f"{garbage}: ") and lines[2]["error"].startswith(f"{deep}: ")
    assert lines[1]["iteration_time_ms"] > 0


def test_cli_json_prints_one_array_for_several_configs_and_csv_one_row_each(tmp_path, run_cli):
    good = write(tmp_path, "good.json", SMALL)
    bad = write(tmp_path, "bad.json", {**SMALL, "global_batch_size": 6})
    # vtrain estimate in a plain subprocess
    single = json.loads(run_cli("estimate", good, "--format", "json", check=True, fresh=True).stdout)
    assert single["config"] == good and single["num_gpus"] == 8
    proc = run_cli("estimate", good, bad, good, "--format", "json")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    documents = json.loads(proc.stdout)
    assert [d["config"] for d in documents] == [good, bad, good]
    assert documents[0] == documents[2] == single and set(documents[1]) == {"config", "error"}

    proc = run_cli("estimate", good, bad, good, "--format", "csv")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"vtrain: error: {documents[1]['error']}"]
    header, *rows = proc.stdout.splitlines()
    columns = header.split(",")
    assert columns[:2] == ["config", "iteration_time_ms"] and "forward_ms" in columns and len(rows) == 2
    assert rows[0] == rows[1] and rows[0].split(",")[:2] == [good, repr(single["iteration_time_ms"])]


TOKENS_PLAN = """
model: {num_layers: 4, hidden_size: 256, num_attention_heads: 8, seq_length: 128}
parallel: {tensor_parallel: 2, pipeline_parallel: 2, data_parallel: 2, micro_batch_size: 2}
training: {global_batch_size: 16, total_tokens: 1e6}
cluster: {preset: dgx-a100}
"""


def test_cli_tokens_override_the_plan_and_give_the_run(tmp_path, run_cli):
    plan = write(tmp_path, "plan.yaml", TOKENS_PLAN)
    line = json.loads(run_cli("estimate", plan, "--tokens", "270e9", "--format", "jsonl", check=True).stdout)
    assert line["total_tokens"] == 2.7e11
    assert line["iterations"] == math.ceil(2.7e11 / (16 * 128)) == 131835938
    assert line["train_days"] == line["iterations"] * line["iteration_time_ms"] / 1e3 / 86400.0
    assert line["train_gpu_hours"] == line["iterations"] * line["iteration_time_ms"] / 1e3 * 8 / 3600.0
    assert line["train_cost_usd"] == line["iterations"] * line["cost_usd"]
    table = run_cli("estimate", plan, check=True).stdout
    assert "to train 1,000,000 tokens: 489 iterations" in table
    proc = run_cli("estimate", plan, plan, "--tokens", "-1", "--format", "jsonl")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["vtrain: error: --tokens must be positive and finite, got -1.0"]


def test_cli_table_and_timeline(tmp_path, run_cli):
    timeline = tmp_path / "t.json"
    proc = run_cli("estimate", write(tmp_path, "c.json", SMALL), "--gpu", "h100", "--timeline", str(timeline),
                   check=True)
    assert "h100-sxm" in proc.stdout and "bubble" in proc.stdout and "iteration" in proc.stdout
    assert json.loads(timeline.read_text())["traceEvents"]


@pytest.mark.parametrize("args,change,message", [
    ((), {"gpu_name": "V100"}, "unknown GPU 'V100'; known: a100-sxm4-40gb, a100-sxm4-80gb"),
    ((), {"inter_node_bandwidth": 0}, "inter_node_bandwidth must be positive, got 0"),
    ((), {"intra_node_bandwidth": -5}, "intra_node_bandwidth must be positive, got -5"),
    ((), {"global_batch_size": 10}, "global_batch_size (10) must be divisible by data_parallel_size (2)"),
    (("--gpu", "tpu-v5"), {}, "unknown GPU 'tpu-v5'"),
])
def test_bad_estimate_input_is_one_line_exit_2(tmp_path, run_cli, args, change, message):
    proc = run_cli("estimate", write(tmp_path, "c.json", {**SMALL, **change}), *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_memory_counts_model_states_and_the_activations_in_flight(gpt3_estimate):
    from vtrain_plugin.capture.tracer import trace

    run = load_run_config(GPT3_CONFIG)
    graph = trace(run.model, run.parallel)  # cached: the graph the estimate used
    first, last = gpt3_estimate.memory_gib[0], gpt3_estimate.memory_gib[-1]
    params = graph.stages[0].num_parameters
    assert first.weights_gib == pytest.approx(params * 2 / 2**30)
    assert first.gradients_gib == pytest.approx(params * 2 / 2**30)
    assert first.optimizer_gib == pytest.approx(params * 12 / 2**30)  # fp32 main weights + two moments
    # 1F1B: the first stage holds p micro-batches, the last one
    assert (first.inflight_microbatches, last.inflight_microbatches) == (16, 1)
    # plus what one micro-batch's step holds beside them and its backward's rise (the recomputed layer)
    stage = graph.stages[0]
    assert stage.backward_peak_nbytes > stage.layer_template().activation_nbytes
    # as a GPU keeps them: dropout masks in a byte (the embedding's; full recompute keeps no layer's)
    from vtrain_plugin.cost.lowering.dropout_masks import dropout_mask_delta
    kept = stage.activation_nbytes + sum(b.count * dropout_mask_delta(b) for b in stage.blocks)
    assert kept < stage.activation_nbytes
    assert first.activations_gib == pytest.approx(
        (kept * 16 + stage.held_nbytes + stage.backward_peak_nbytes) / 2**30)
    # full recompute keeps each layer's input: [s, b, h] in fp16 per layer, plus the embedding output
    layer = graph.stages[5].layer_template()
    assert layer.activation_nbytes >= 2048 * 12288 * 2
    assert gpt3_estimate.fits_in_memory and gpt3_estimate.peak_memory_gib < 80


def test_same_llama_plan_gives_byte_identical_json_in_two_processes(tmp_path, run_cli):
    """Determinism across processes (issue 10: 30.84 vs 32.84 GiB for one Llama plan, fixed in the
    recorder): traced activations, memory and every time are the same bytes in two fresh processes."""
    import yaml

    plan = tmp_path / "llama.yaml"
    plan.write_text(yaml.safe_dump({
        "model": {"family": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                  "num_query_groups": 4, "seq_length": 128, "vocab_size": 1024, "dtype": "bf16"},
        "parallel": {"tensor_parallel": 2, "pipeline_parallel": 2, "virtual_pipeline": 2, "data_parallel": 2,
                     "sequence_parallel": True, "recompute": "selective"},
        "training": {"global_batch_size": 16, "schedule": "interleaved_1f1b", "grad_reduce": "overlap"},
        "cluster": {"preset": "dgx-h100"}}))
    # no trace cache: the second process must trace again, not read the first one's trace back
    first, second = (run_cli("estimate", str(plan), "--format", "json", "--no-cache", check=True).stdout
                     for _ in range(2))
    assert first == second
    assert json.loads(first)["memory_gib_per_stage"]


def test_estimates_as_a_dataframe(gpt3_estimate):
    from vtrain_plugin import estimates_frame

    frame = estimates_frame([gpt3_estimate, gpt3_estimate], index=["a", "b"])
    assert list(frame.index) == ["a", "b"]
    assert frame.loc["a", "iteration_time_ms"] == gpt3_estimate.iteration_time_ms
    assert frame.loc["b", "bubble_ms"] == gpt3_estimate.breakdown_ms["bubble"]
    assert frame.loc["a", "peak_memory_gib"] == gpt3_estimate.peak_memory_gib
    one = gpt3_estimate.to_frame()
    assert one.shape[0] == 1 and set(frame.columns) == set(one.columns)
    assert {f"{part}_ms" for part in BREAKDOWN_FIELDS} <= set(one.columns)


def test_explain_lists_each_kernel_use_per_stage_not_summed_over_stages():
    """Regression: one GEMM shape used by a forward, its recompute and a backward was summed over all
    uses and all 16 stages, and listed at 136 s in a 54 s iteration."""
    e = estimate(load_run_config(GPT3_CONFIG), explain=6)
    uses = [(k.op, k.input_shapes, k.phase, k.module) for k in e.largest_unmeasured]
    assert len(uses) == len(set(uses)) == 6
    assert all(0 < k.time_ms < e.iteration_time_ms for k in e.largest_unmeasured)
    fc1 = {k.phase: k.time_ms for k in e.largest_unmeasured if k.module.endswith("mlp.linear_fc1")
           and k.input_shapes == ((2048, 12288), (12288, 6144))}
    assert set(fc1) == {"forward", "recompute"} and fc1["forward"] == fc1["recompute"]
    layers_per_stage, micro_batches = 96 // 16, 1536 // 4
    per_kernel_ms = fc1["forward"] / (layers_per_stage * micro_batches)
    assert e.breakdown_ms["forward"] > layers_per_stage * micro_batches * per_kernel_ms
