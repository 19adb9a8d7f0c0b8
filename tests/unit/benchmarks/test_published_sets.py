"""benchmarks/accuracy: the B200, H100 and functional-test readers turn the shared CSVs into the runs the
joint calibration fits, with the measured times the rows state or imply."""

from benchmarks.accuracy import b200_data, ci_data, h100_data
from vtrain_plugin.estimate import estimate


def test_b200_rows_become_fp8_plans_timed_from_their_throughput():
    runs = {r.name: r for r in b200_data.read_runs()}
    assert sorted(runs) == ["GPT3-175B-B200", "LLAMA3-70B-B200", "LLAMA3-8B-B200"]
    gpt = runs["GPT3-175B-B200"]
    assert gpt.measured_ms == 1000.0 * 2048 * 2048 / (1600.0 * 512)  # global batch x seq / (tokens/s/GPU x GPUs)
    plan = gpt.run
    assert (plan.parallel.tensor_parallel, plan.parallel.pipeline_parallel, plan.parallel.virtual_pipeline,
            plan.parallel.data_parallel) == (4, 4, 6, 32)
    assert plan.training.fp8 is not None and plan.training.tp_comm_overlap and plan.cluster.gpu == "b200-sxm"
    llama = runs["LLAMA3-70B-B200"].run
    assert (llama.parallel.context_parallel, llama.parallel.data_parallel) == (2, 4)


def test_functional_test_rows_are_read_as_the_cli_reads_their_arguments():
    runs = ci_data.read_runs()
    assert len(runs) == 99 and {ci_data.test_case_of(r.name) for r in runs} >= {"gpt3_mcore_te_tp2_pp2"}
    first = runs[0]
    assert first.name == "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic (A100)"
    assert first.measured_ms == 319.265 and first.config["gpu"] == "a100-sxm4-80gb"
    run = first.run
    assert (run.parallel.context_parallel, run.parallel.pipeline_parallel, run.parallel.expert_parallel) == (2, 2, 2)
    assert run.cluster.gpu == "a100-sxm4-80gb" and not run.training.deterministic
    flagged = ["--deterministic-mode" in r.config["megatron_args"].split() for r in runs[:6]]
    assert [r.run.training.deterministic for r in runs[:6]] == flagged == [False, False, True, True, True, True]


def test_nemo_runs_use_the_distributed_optimizer_and_then_fit_their_gpus():
    # NeMo's recipes shard the optimizer and overlap its gradient reduce-scatter and parameter
    # all-gather; without the sharding none of these runs would fit its GPU, and all of them ran.
    for r in b200_data.read_runs() + h100_data.read_runs():
        training = r.run.training
        assert training.distributed_optimizer and training.overlap_param_gather, r.name
    for r in b200_data.read_runs():
        assert estimate(r.run).fits_in_memory, r.name


def test_nemo_runs_overlap_tensor_parallel_communication_where_they_have_it():
    # the B200 rows state NeMo's recipe setting; the H100 rows of the same recipes take it at TP > 1
    for r in h100_data.read_runs():
        assert r.run.training.tp_comm_overlap == (r.run.parallel.tensor_parallel > 1), r.name
    assert [r.run.training.tp_comm_overlap for r in b200_data.read_runs()] == [True, False, True]
