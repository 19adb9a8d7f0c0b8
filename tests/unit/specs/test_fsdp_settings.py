"""FSDP settings: validation, the plan-file round trip and the Megatron-LM flags that set them."""

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.fsdp import FsdpImplementation, FsdpSettings, ShardingStrategy
from vtrain_plugin.specs.megatron.args import megatron_plan
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.plan_file import parse_plan
from vtrain_plugin.specs.training import TrainingSpec

BASE = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 --vocab-size 1000"


def megatron(flags: str, gpus: int = 8):
    return megatron_plan(read_command_line(f"{BASE} {flags}"), gpus=gpus)


def megatron_error(flags: str, gpus: int = 8) -> str:
    with pytest.raises(ConfigError) as exc:
        megatron(flags, gpus)
    return str(exc.value)


def test_megatron_fsdp_flags_set_the_settings():
    fsdp = megatron("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer "
                    "--suggested-communication-unit-size 800000000 --use-nccl-ub --fsdp-manual-registration "
                    "--outer-dp-sharding-strategy optim").training.fsdp
    assert fsdp == FsdpSettings(sharding_strategy=ShardingStrategy.OPTIM_GRADS, double_buffer=True,
                                communication_unit_elements=800_000_000)


def test_megatron_fsdp_defaults_are_megatrons():
    assert megatron("--use-megatron-fsdp").training.fsdp == FsdpSettings()  # optim_grads_params, no double buffer
    assert megatron("--use-custom-fsdp").training.fsdp == FsdpSettings()  # the flag's name before 0.14
    assert megatron("").training.fsdp is None
    # Megatron-LM reads the strategy only with FSDP on: alone it changes nothing
    assert megatron("--data-parallel-sharding-strategy optim").training.fsdp is None


def test_torch_fsdp2_flags():
    assert megatron("--use-torch-fsdp2").training.fsdp == FsdpSettings(implementation=FsdpImplementation.TORCH)
    fsdp = megatron("--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward").training.fsdp
    assert (fsdp.implementation, fsdp.reshard_after_forward) == (FsdpImplementation.TORCH, False)


@pytest.mark.parametrize("flags, message", [
    ("--use-megatron-fsdp --use-torch-fsdp2", "--use-megatron-fsdp with --use-torch-fsdp2: one FSDP implementation "
                                              "at a time"),
    ("--fsdp-double-buffer", "--fsdp-double-buffer needs --use-megatron-fsdp"),
    ("--use-torch-fsdp2 --fsdp-double-buffer", "--fsdp-double-buffer needs --use-megatron-fsdp"),
    ("--torch-fsdp2-no-reshard-after-forward", "--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy all",
     "--data-parallel-sharding-strategy must be one of no_shard, optim, optim_grads, optim_grads_params, got 'all'"),
    ("--use-megatron-fsdp --num-distributed-optimizer-instances 2",
     "--num-distributed-optimizer-instances 2: HSDP (FSDP inside replicas) is not modelled by vtrain yet"),
    ("--num-distributed-optimizer-instances 2",
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer (megatron-core asserts a partial "
     "distributed optimizer is a distributed optimizer)"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 3",
     "parallel.distributed_optimizer_instances (3) must divide data_parallel * context_parallel (8)"),
    ("--use-megatron-fsdp --suggested-communication-unit-size 0",
     "--suggested-communication-unit-size must be a positive integer, got 0"),
])
def test_megatron_refusals_are_one_line(flags, message):
    assert megatron_error(flags) == message


def test_one_distributed_optimizer_instance_is_accepted():
    assert megatron("--num-distributed-optimizer-instances 1").training.fsdp is None


def test_distributed_optimizer_instances_set_the_plan_and_round_trip_through_a_plan_file():
    run = megatron("--use-distributed-optimizer --num-distributed-optimizer-instances 2")
    assert (run.training.fsdp, run.training.distributed_optimizer) == (None, True)
    assert run.parallel.distributed_optimizer_instances == 2
    assert run.parallel.optimizer_shard_group_size == 4
    plan = parse_plan({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                 "vocab_size": 100},
                       "parallel": {"data_parallel": 8, "distributed_optimizer_instances": 2},
                       "training": {"global_batch_size": 8, "distributed_optimizer": True}})
    assert plan.parallel.to_dict()["distributed_optimizer_instances"] == 2
    assert plan.parallel == run.parallel.__class__(**plan.parallel.to_dict())
    assert megatron("").parallel.distributed_optimizer_instances == 1


def test_distributed_optimizer_instances_need_the_distributed_optimizer_in_a_plan():
    plan = ParallelPlan(data_parallel=4, distributed_optimizer_instances=2)
    with pytest.raises(ConfigError, match=r"^parallel.distributed_optimizer_instances 2: it needs "
                                          r"training.distributed_optimizer: true \(megatron-core asserts it\)$"):
        TrainingSpec(global_batch_size=8).check_plan(plan)
    with pytest.raises(ConfigError, match="HSDP"):
        TrainingSpec(global_batch_size=8, distributed_optimizer=True, fsdp=FsdpSettings()).check_plan(plan)
    TrainingSpec(global_batch_size=8, distributed_optimizer=True).check_plan(plan)


@pytest.mark.parametrize("given, message", [
    ({"sharding_strategy": "zero3"}, "training.fsdp.sharding_strategy must be one of no_shard, optim, optim_grads, "
                                     "optim_grads_params; got 'zero3'"),
    ({"implementation": "torch", "sharding_strategy": "optim"},
     "training.fsdp.sharding_strategy optim with implementation torch: torch FSDP2 shards weights, gradients and "
     "optimizer state (optim_grads_params)"),
    ({"reshard_after_forward": False}, "training.fsdp.reshard_after_forward false is torch FSDP2's: it needs "
                                       "implementation torch (Megatron-FSDP reshards after forward)"),
    ({"double_buffer": 1}, "training.fsdp.double_buffer must be true or false"),
    ({"prefetch": 2}, "training.fsdp: unknown key 'prefetch'"),
])
def test_settings_refusals(given, message):
    with pytest.raises(ConfigError) as exc:
        TrainingSpec(global_batch_size=8, fsdp=given)
    assert str(exc.value).startswith(message)


def test_torch_fsdp2_refuses_pipeline_parallelism():
    training = TrainingSpec(global_batch_size=8, fsdp={"implementation": "torch"})
    with pytest.raises(ConfigError, match="torch FSDP2 does not run with pipeline parallelism"):
        training.check_plan(ParallelPlan(pipeline_parallel=2, data_parallel=4, micro_batch_size=1))


def test_plan_file_round_trip():
    section = {"implementation": "megatron", "sharding_strategy": "optim_grads", "double_buffer": True,
               "reshard_after_forward": True, "communication_unit_elements": 4096, "grad_comm_dtype": None}
    plan = parse_plan({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                 "vocab_size": 100},
                       "parallel": {"data_parallel": 8, "micro_batch_size": 1},
                       "training": {"global_batch_size": 8, "fsdp": section}})
    assert plan.training.fsdp == FsdpSettings(sharding_strategy=ShardingStrategy.OPTIM_GRADS, double_buffer=True,
                                              communication_unit_elements=4096)
    assert plan.training.to_dict()["fsdp"] == section
    assert TrainingSpec(global_batch_size=8, fsdp=plan.training.to_dict()["fsdp"]).fsdp == plan.training.fsdp


def test_strategy_decides_the_sharded_optimizer():
    assert TrainingSpec(global_batch_size=8, fsdp={"sharding_strategy": "optim"}).shards_optimizer
    # FSDP's no_shard keeps the optimizer whole even beside --use-distributed-optimizer
    assert not TrainingSpec(global_batch_size=8, distributed_optimizer=True,
                            fsdp={"sharding_strategy": "no_shard"}).shards_optimizer
    assert TrainingSpec(global_batch_size=8, distributed_optimizer=True).shards_optimizer


def test_megatron_fsdp_dtype_flags():
    fsdp = megatron("--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype fp32 "
                    "--megatron-fsdp-main-params-dtype fp32").training.fsdp
    assert fsdp == FsdpSettings(grad_comm_dtype="bf16")
    assert megatron("--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype auto").training.fsdp == FsdpSettings()
    assert FsdpSettings.of(fsdp.to_dict()) == fsdp
    assert megatron_error("--use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16") == \
        "--megatron-fsdp-main-grads-dtype bf16: vtrain prices Megatron-FSDP's buffer in auto or fp32 only"
    assert megatron_error("--use-megatron-fsdp --megatron-fsdp-main-params-dtype bf16") == \
        "--megatron-fsdp-main-params-dtype bf16: vtrain prices Megatron-FSDP's buffer in fp32 only"
    assert megatron_error("--megatron-fsdp-grad-comm-dtype bf16") == \
        "--megatron-fsdp-grad-comm-dtype needs --use-megatron-fsdp"
    assert megatron_error("--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype int8") == \
        "--megatron-fsdp-grad-comm-dtype must be one of fp32, fp16, bf16, auto, got 'int8'"
