"""The shipped Llama 3 405B plan file is Meta's published layout (Llama 3 paper, Table 4: TP 8, CP 1,
PP 16, DP 128 at 8K, interleaved schedule) and fits an 80 GB H100 as vtrain prices it."""

from vtrain_plugin.specs.training import ScheduleKind
from vtrain_plugin.estimate import estimate
from vtrain_plugin.runs import load_run_config

FILE = "examples/configs/llama3_405b_16384gpu.yaml"


def test_llama3_405b_example_is_metas_interleaved_layout_and_fits():
    run = load_run_config(FILE)
    p = run.parallel
    assert (p.tensor_parallel, p.context_parallel, p.pipeline_parallel, p.data_parallel) == (8, 1, 16, 128)
    assert run.training.schedule is ScheduleKind.INTERLEAVED_1F1B and p.virtual_pipeline > 1
    assert run.training.global_batch_size * run.model.seq_length == 2048 * 8192  # 16M tokens
    est = estimate(run)
    assert est.num_gpus == 16384
    assert est.fits_in_memory, est.peak_memory_gib
