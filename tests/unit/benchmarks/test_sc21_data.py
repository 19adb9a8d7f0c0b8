"""benchmarks/accuracy/sc21_data.py: the ten runs of Narayanan et al. (SC'21) Table 1 become the plans
Megatron-LM ran, interleaving included (the calibration and accuracy scripts trust these plans)."""

import pytest

from benchmarks.accuracy import sc21_data
from vtrain_plugin.specs import ScheduleKind

# model: (GPUs, schedule, model chunks per pipeline rank, global batch), from the CSV and
# num_layers / (pp x layers_per_virtual_stage).
EXPECTED = {
    "GPT-1.7B": (32, ScheduleKind.ONE_F_ONE_B, 1, 512),
    "GPT-3.6B": (64, ScheduleKind.ONE_F_ONE_B, 1, 512),
    "GPT-7.5B": (128, ScheduleKind.ONE_F_ONE_B, 1, 512),
    "GPT-18.4B": (256, ScheduleKind.ONE_F_ONE_B, 1, 1024),
    "GPT-39.1B": (512, ScheduleKind.ONE_F_ONE_B, 1, 1536),
    "GPT-76.1B": (1024, ScheduleKind.INTERLEAVED_1F1B, 3, 1792),
    "GPT-145.6B": (1536, ScheduleKind.INTERLEAVED_1F1B, 2, 2304),
    "GPT-310.1B": (1920, ScheduleKind.INTERLEAVED_1F1B, 2, 2160),
    "GPT-529.6B": (2520, ScheduleKind.INTERLEAVED_1F1B, 3, 2520),
    "GPT-1008B": (3072, ScheduleKind.ONE_F_ONE_B, 1, 3072),
}


def test_the_ten_runs_have_the_published_plans():
    runs = sc21_data.read_runs()
    got = {}
    for r in runs:
        run = r.run
        assert r.source == "sc21" and r.measured_ms > 0
        assert run.cluster.gpu == "a100-sxm4-80gb" and run.model.vocab_size == 51200
        got[run.model.name] = (run.parallel.world_size, run.training.schedule, run.parallel.virtual_pipeline,
                               run.training.global_batch_size)
    assert got == EXPECTED


def test_a_row_whose_parallel_sizes_do_not_multiply_to_its_gpus_is_refused():
    row = {"model": "GPT-x", "tp": "8", "pp": "2", "dp": "3", "gpus": "64", "recompute": "full",
           "layers_per_virtual_stage": ""}
    with pytest.raises(ValueError, match=r"tp \(8\) \* pp \(2\) \* dp \(3\) = 48 != gpus \(64\)"):
        sc21_data.plan_mapping(row)


def test_virtual_stages_must_divide_the_layers_of_a_pipeline_rank():
    row = {"model": "GPT-x", "num_layers": "60", "pp": "4", "layers_per_virtual_stage": "4"}
    with pytest.raises(ValueError, match=r"num_layers \(60\) is not divisible by pp \(4\) \* layers_per_virtual_stage"):
        sc21_data.virtual_pipeline(row)
