"""``size_model()`` and ``vtrain size`` on a ladder of tiny GPTs: the answer keeps its own budget."""

import json

import pytest

from vtrain_plugin.cli import main
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.planning.sizing import size_model
from vtrain_plugin.planning.space import SearchSpace

CLUSTER = get_cluster_preset("dgx-a100")
# Shapes of 15M, 46M, 84M, 155M and 250M parameters; one plan per shape keeps the searches small.
LADDER = {"min_params": 5e6, "max_params": 3e8, "hidden_step": 256}
SPACE = SearchSpace(tensor_parallel=(1,), pipeline_parallel=(1,), micro_batch_size=(1,), virtual_pipeline=(1,),
                    sequence_parallel=(False,), recompute=("full",), grad_reduce=("overlap",),
                    distributed_optimizer=(False,))
DAYS = 0.05


@pytest.fixture(scope="module")
def sized():
    return size_model("gpt", cluster=CLUSTER, gpus=8, days=DAYS, space=SPACE, workers=1, batch_tokens=2**16,
                      **LADDER)


def test_answer_keeps_its_budget_and_the_tokens_per_parameter_rule(sized):
    answer = sized.answer
    assert answer.within_budget
    assert answer.train_days <= DAYS
    assert answer.tokens == 20 * answer.model.num_parameters
    assert answer.plan["num_gpus"] == 8
    larger = [o for o in sized.evaluated if o.model.num_parameters > answer.model.num_parameters]
    assert larger and not any(o.within_budget for o in larger)
    assert all(o.train_days > DAYS if o.floor_days is None else o.floor_days > DAYS for o in larger)


def test_days_grow_with_the_shape(sized):
    days = [o.train_days for o in sized.evaluated if o.plan is not None]  # not those over budget by floors alone
    assert len(days) >= 2 and days == sorted(days)


def test_naive_fixed_mfu_answer_is_reported_with_vtrains_verdict(sized):
    assert sized.naive is not None
    assert sized.naive.flops <= sized.naive.budget_flops
    assert sized.naive_outcome.model == sized.naive.model
    assert sized.naive.model.num_parameters >= sized.answer.model.num_parameters
    table = sized.table()
    assert table["answer"].sum() == 1 and table["naive"].sum() == 1


def test_budget_too_small_is_one_error():
    with pytest.raises(ConfigError, match="budget too small: the smallest shape"):
        size_model("gpt", cluster=CLUSTER, gpus=8, days=1e-6, space=SPACE, workers=1, batch_tokens=2**16,
                   **LADDER)


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "A100", "--gpus", "8"], "give a budget"),
    (["--gpu", "A100", "--gpus", "8", "--days", "-3"], "--days must be a positive number"),
    (["--gpu", "A100", "--gpus", "8", "--days", "3", "--family", "bert"], "--family must be one of"),
    (["--gpu", "A100", "--gpus", "8", "--days", "3", "--mfu", "1.5"], "--mfu must lie in"),
    (["--gpu", "A100", "--gpus", "eight", "--days", "3"], "gpus"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["size", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_cli_json(tmp_path, capsys):
    args = ["size", "--gpu", "A100", "--gpus", "8", "--days", str(DAYS), "--min-params", "5e6", "--max-params",
            "1e8", "--hidden-step", "256", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--vp", "1", "--sp", "off",
            "--recompute", "full", "--grad-reduce", "overlap", "--batch-tokens", "65536", "--workers", "1",
            "--format", "json", "--plot", str(tmp_path / "size.png")]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["answer"]["within_budget"] and out["answer"]["train_days"] <= DAYS
    assert (tmp_path / "size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_plan_at_an_exact_count_names_the_cause_not_the_budget(run_cli):
    """3,360 = 2^5 x 105: DP must divide the 2,048 sequences, so some TP x PP <= 8 x 24 must be a
    multiple of 105: none is. That is no plan at that count, not a budget too small."""
    proc = run_cli("size", "--gpus", "3360", "--gpu", "A100", "--days", "30")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "vtrain: error: size: not a budget too small: no plan of the smallest shape, gpt-h3072-l24, uses exactly "
        "3360 GPUs (a count is exact; 1:3360 allows any count up to it): TP x CP x PP x DP must be such a count "
        "with DP x micro-batch dividing the global batch of 2,048 sequences (4,194,304 batch tokens // 2,048 per "
        "sequence), TP the 24 heads and PP the 24 layers; no valid plan: 48 skipped (gpus not in budget: 10, "
        "global_batch % (dp*micro_batch): 38)"]
    assert "a count (exactly that many: 3360)" in " ".join(run_cli("size", "--help").stdout.split())


def test_a_dollar_budget_fills_the_naive_answer():
    """The naive answer's FLOPs are those the dollars buy: USD / price GPU-hours at the peak and MFU."""
    usd = 50.0
    sized = size_model("gpt", cluster=CLUSTER, gpus=8, budget_usd=usd, space=SPACE, workers=1,
                       batch_tokens=2**16, **LADDER)
    peak = 312e12  # A100 dense fp16 tensor FLOP/s (NVIDIA A100 datasheet)
    assert sized.naive is not None and sized.naive_outcome.model == sized.naive.model
    assert sized.naive.budget_flops == pytest.approx(usd / CLUSTER.price_per_gpu_hour_usd * 3600 * peak * 0.5,
                                                     rel=1e-12)
    assert sized.to_dict()["naive"]["budget_flops"] == sized.naive.budget_flops
    assert sized.table()["naive"].sum() == 1


SMALL = ["--gpu", "A100", "--gpus", "8", "--days", str(DAYS), "--min-params", "5e6", "--max-params", "5e7",
         "--hidden-step", "256", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--vp", "1", "--sp", "off",
         "--recompute", "full", "--grad-reduce", "overlap", "--batch-tokens", "65536", "--workers", "1", "--no-db"]


def test_cli_ladder_settings_shape_every_model_and_are_printed(run_cli):
    help_text = " ".join(run_cli("size", "--help", check=True).stdout.split())
    for default in ("llama 8192)", "llama 128256)", "gpt mha, llama 8)", "(default: none, dense)", "(default 2)"):
        assert default in help_text, default
    proc = run_cli("size", *SMALL, "--family", "llama", "--seq-length", "1024", "--vocab-size", "4096",
                   "--query-groups", "2", "--experts", "4", "--top-k", "1", "--format", "json", check=True,
                   fresh=True)  # vtrain size in a plain subprocess
    out = json.loads(proc.stdout)
    assert {k: out["ladder"][k] for k in ("family", "vocab_size", "seq_length", "num_query_groups", "num_experts",
                                          "moe_router_topk")} == {
        "family": "llama", "vocab_size": 4096, "seq_length": 1024, "num_query_groups": 2, "num_experts": 4,
        "moe_router_topk": 1}
    assert out["evaluated"] and all(o["model"].endswith("-e4k1") for o in out["evaluated"])
    table = run_cli("size", *SMALL, "--family", "llama", "--seq-length", "1024", "--vocab-size", "4096",
                    "--query-groups", "mha", check=True).stdout
    assert table.splitlines()[0] == "ladder: llama, vocabulary 4,096, sequence 1,024, multi-head attention, dense, bf16"


@pytest.mark.parametrize("argv, message", [
    (["--family", "llama"], "vtrain: error: --query-groups 8 must divide every shape's heads (hidden / 128): "
                            "--hidden-step must then be a multiple of 128 x 8 = 1024, got 256"),
    (["--query-groups", "2", "--top-k", "2"], "vtrain: error: --top-k needs --experts (a mixture-of-experts ladder)"),
    (["--experts", "2", "--top-k", "3"], "vtrain: error: --top-k (3) must not exceed --experts (2)"),
    (["--seq-length", "0"], "vtrain: error: --seq-length must be a positive integer, got '0'"),
    (["--query-groups", "x"], "vtrain: error: --query-groups must be a positive integer or mha, got 'x'"),
])
def test_cli_bad_ladder_settings_are_one_line_exit_2(argv, message, run_cli):
    proc = run_cli("size", *SMALL, *argv)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message]
