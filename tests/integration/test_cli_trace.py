"""The real ``vtrain trace`` CLI in a subprocess: output formats and one-line errors with exit 2."""

import json

import pytest

SMALL = {
    "num_gpus": 8, "gpu_name": "A100", "tensor_parallel_size": 2, "data_parallel_size": 2,
    "pipeline_parallel_size": 2, "global_batch_size": 16, "micro_batch_size": 2, "num_layers": 4,
    "hidden_size": 256, "num_attention_heads": 8, "max_length": 128, "vocab_size": None,
    "use_checkpoint": True, "use_gradient_bucket": False, "ddp_bucket_size": 40,
    "inter_node_bandwidth": 1600, "intra_node_bandwidth": 300, "pipeline_scheduling": "1f1b",
    "node_size": 8, "trace_path": "/tmp/ignored",
}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_trace_json_lists_ops_and_collectives_per_stage(tmp_path, run_cli):
    out = tmp_path / "trace.json"
    run_cli("trace", write(tmp_path, "c.json", SMALL), "--format", "json", "--output", str(out), check=True,
            fresh=True)  # vtrain trace in a plain subprocess
    data = json.loads(out.read_text())
    assert [s["pipeline_rank"] for s in data["stages"]] == [0, 1]
    assert data["model"]["vocab_size"] == 50257  # null means GPT-2's vocabulary
    for stage in data["stages"]:
        assert stage["num_layers"] == 2
        op = stage["ops"][0]
        assert {"op", "input_shapes", "dtypes", "phase", "module", "count", "flops"} <= op.keys()
        kinds = {c["kind"] for c in stage["collectives"]}
        assert {"all_reduce", "send", "recv"} <= kinds
        for c in stage["collectives"]:
            assert {"kind", "nbytes", "group", "group_size", "phase", "module", "count"} <= c.keys()
            assert c["group"] in ("tp", "dp", "pp", "embedding")
    assert (data["software_stack"], data["fp8"]) == ("megatron_deepspeed_2023", None)  # a vTrain config's
    softmax = [k for k in data["stages"][0]["stack_kernels"] if "masked_softmax" in k["op"]]
    assert {(k["op"], k["phase"], k["count"]) for k in softmax} == {
        ("megatron.scaled_upper_triang_masked_softmax.default", "forward", 2),
        ("megatron.scaled_upper_triang_masked_softmax.default", "recompute", 2),
        ("megatron.scaled_upper_triang_masked_softmax_backward.default", "backward", 2)}
    fc1 = [o for o in data["stages"][0]["ops"] if o["module"] == "decoder.layers.0.mlp.linear_fc1"
           and o["op"] == "aten.mm.default" and o["phase"] == "forward"]
    assert len(fc1) == 1 and fc1[0]["count"] == 2 and fc1[0]["input_shapes"] == [[256, 256], [256, 512]]
    tp = [c for c in data["stages"][0]["collectives"] if c["group"] == "tp" and c["phase"] == "forward"
          and c["module"].startswith("decoder.layers.0")]
    assert {(c["kind"], c["nbytes"], c["group_size"], c["count"]) for c in tp} == {("all_reduce", 128 * 2 * 256 * 2, 2, 2)}


def test_trace_table_and_plan_file(tmp_path, run_cli):
    plan = """
model: {family: llama, num_layers: 4, hidden_size: 256, num_attention_heads: 8, num_query_groups: 2,
        seq_length: 128, vocab_size: 1000, dtype: bf16}
parallel: {tensor_parallel: 2, pipeline_parallel: 2, data_parallel: 1, sequence_parallel: true,
           micro_batch_size: 1}
training: {global_batch_size: 8}
"""
    proc = run_cli("trace", write(tmp_path, "plan.yaml", plan), check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model: llama") and lines[0].endswith("stack: megatron_core_te")
    assert "all_gather tp" in proc.stdout and "reduce_scatter tp" in proc.stdout
    # per layer: norm, QKV, 2 RoPE, attention, projection, add, norm, FC1, SwiGLU, FC2, add
    assert lines[2].split()[:7] == ["stage", "layers", "kind", "fwd/layer", "bwd/layer", "recomp/layer", "stack"]
    assert [line.split()[:3] + line.split()[6:7] for line in lines[4:6]] == [["0", "2", "dense", "12/17/0"],
                                                                           ["1", "2", "dense", "12/17/0"]]
    assert proc.stderr == ""
    fp8_plan = plan.replace("training: {global_batch_size: 8}", "training: {global_batch_size: 8, fp8: hybrid}")
    fp8 = run_cli("trace", write(tmp_path, "fp8.yaml", fp8_plan + "cluster: {preset: dgx-h100}\n"), check=True)
    assert fp8.stdout.splitlines()[0].endswith("stack: megatron_core_te (fp8 hybrid, delayed scaling)")


def test_trace_lowers_with_the_plans_unfused_attention_and_jit_fusions(tmp_path, run_cli):
    # The stack's kernels as the estimate costs them: TE's unfused attention, RoPE and SwiGLU unfused.
    plan = """
model: {family: llama, num_layers: 2, hidden_size: 256, num_attention_heads: 8, seq_length: 128, vocab_size: 1000,
        dtype: bf16}
parallel: {micro_batch_size: 1}
training: {global_batch_size: 8%s}
"""
    kernels, counts = [], []
    for options in ("", ", unfused_kernels: [rope, bias_activation], unfused_attention: true"):
        out, path = tmp_path / "trace.json", write(tmp_path, "plan.yaml", plan % options)
        run_cli("trace", path, "--format", "json", "--output", str(out), check=True)
        kernels.append({k["op"] for k in json.loads(out.read_text())["stages"][0]["stack_kernels"]})
        counts.append(run_cli("trace", path, check=True).stdout.splitlines()[4].split()[6])  # stack fwd/bwd/recomp
    fused, unfused = kernels
    gone = {"te.fused_attention.default", "te.fused_rope.default", "megatron.swiglu_fused.default"}
    assert gone <= fused and not gone & unfused
    assert {"megatron.scaled_upper_triang_masked_softmax.default", "aten.silu.default", "aten.sin.default"} <= unfused
    fewer, more = ([int(n) for n in count.split("/")] for count in counts)
    assert more[0] > fewer[0] and more[1] > fewer[1]


def test_trace_shows_every_layer_kind_of_every_stage(tmp_path, run_cli):
    """Dense and MoE layers mixed, an MTP layer in the last stage's head (JSON); NoPE layers (table)."""
    plan = """
model: {family: llama, num_layers: 8, hidden_size: 256, num_attention_heads: 8, seq_length: 128, vocab_size: 1000,
        dtype: bf16, num_experts: 4, moe_layer_freq: [0, 1, 1, 1, 0, 1, 1, 1], mtp_num_layers: 1}
parallel: {pipeline_parallel: 2, data_parallel: 2, expert_parallel: 2}
training: {global_batch_size: 8}
"""
    data = json.loads(run_cli("trace", write(tmp_path, "moe.yaml", plan), "--format", "json", check=True).stdout)
    assert [[(k["kind"], k["count"]) for k in stage["layer_kinds"]] for stage in data["stages"]] == [
        [("dense", 1), ("MoE", 3)], [("dense", 1), ("MoE", 3), ("MTP MoE", 1)]]
    nope = plan.replace("num_experts: 4, moe_layer_freq: [0, 1, 1, 1, 0, 1, 1, 1], mtp_num_layers: 1",
                        "no_rope_freq: 4").replace(", expert_parallel: 2", "")
    lines = run_cli("trace", write(tmp_path, "nope.yaml", nope), check=True).stdout.splitlines()
    assert [line.split()[:3] for line in lines[4:8]] == [["0", "1", "dense"], ["0", "3", "dense"],
                                                           ["1", "1", "dense"], ["1", "3", "dense"]]
    nope_row, rope_row = lines[4].split(), lines[5].split()
    assert nope_row[3] == "NoPE" and rope_row[3] != "NoPE"
    assert int(nope_row[4]) < int(rope_row[3])  # forward ops per layer: no rotary embedding


@pytest.mark.parametrize("change,message", [
    ({"tensor_parallel_size": 3, "num_gpus": 12}, "tensor_parallel_size (3) must divide num_attention_heads (8)"),
    ({"pipeline_parallel_size": 3, "num_gpus": 12}, "pipeline_parallel_size (3) must divide num_layers (4)"),
    ({"num_gpus": 16}, "num_gpus (16) must equal tensor_parallel_size (2) * pipeline_parallel_size (2) * data_parallel_size (2) = 8"),
    ({"hidden_size": 0}, "model.hidden_size must be positive, got 0"),
    ({"micro_batch_size": -1}, "parallel.micro_batch_size must be positive, got -1"),
    ({"color": "blue"}, "vTrain config: unknown key 'color'"),
    ({"pipeline_scheduling": "zigzag"}, "pipeline_scheduling must be one of"),
])
def test_bad_vtrain_config_is_one_line_exit_2(tmp_path, run_cli, change, message):
    proc = run_cli("trace", write(tmp_path, "bad.json", {**SMALL, **change}))
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name,text,message", [
    ("bad.json", '{"num_gpus": 8,', "malformed JSON"),
    ("bad.yaml", "model: [1, 2\nparallel: {", "malformed YAML"),
    ("list.json", "[1, 2]", "the top level must be a mapping"),
    ("plan.yaml", "model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32}\n"
                  "parallel: {tensor_parallel: 1, data_parallel: 2, micro_batch_size: 2}\n"
                  "training: {global_batch_size: 6}\n",
     "global_batch_size (6) must be divisible by data_parallel_size (2) * micro_batch_size (2) = 4"),
    ("plan.yaml", "model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32}\n"
                  "parallel: {tensor_parallel: 1, tensor: 2}\ntraining: {global_batch_size: 4}\n",
     "parallel: unknown key 'tensor'"),
    ("plan.yaml", "model: {num_layers: 126, hidden_size: 64, num_attention_heads: 4, seq_length: 32}\n"
                  "parallel: {pipeline_parallel: 8, virtual_pipeline: 3, account_for_embedding_in_pipeline_split: true,"
                  " account_for_loss_in_pipeline_split: true}\ntraining: {global_batch_size: 24}\n",
     "the 16 layer slots of pipeline rank 0 must be divisible by virtual_pipeline (3)"),
    ("plan.yaml", "model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32}\n"
                  "parallel: {data_parallel: 2}\ntraining: {global_batch_size: 4, overlap_param_gather: true}\n",
     "training.overlap_param_gather requires training.distributed_optimizer: true"),
    ("plan.yaml", "model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32}\n"
                  "parallel: {data_parallel: 2}\ntraining: {global_batch_size: 4, distributed_optimizer: 1}\n",
     "training.distributed_optimizer must be true or false, got 1"),
])
def test_malformed_files_are_one_line_exit_2(tmp_path, run_cli, name, text, message):
    proc = run_cli("trace", write(tmp_path, name, text))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_missing_file_is_one_line_exit_2(tmp_path, run_cli):
    proc = run_cli("trace", str(tmp_path / "nope.json"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
