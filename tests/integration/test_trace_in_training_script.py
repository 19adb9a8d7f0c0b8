"""Tracing inside a training script: torch.distributed initialised (gloo, world size 1), megatron-core's
parallel state set up as a training script does, and the model the script built traced and estimated
for another plan. Regression: ``trace(gpt_model, sample_input=...)`` raised ``TypeError: cannot
pickle ... ProcessGroup`` (the model was deep-copied) and tracing a TransformerConfig was refused
("torch.distributed is already initialized")."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import vtrain_plugin as vtrain
from vtrain_plugin.capture import child_trace
from vtrain_plugin.capture.tracer import clear_cache
from vtrain_plugin.core.graph import ParallelGroup, Phase
from vtrain_plugin.specs.model import Family

VOCAB, SEQ, BATCH = 128, 32, 2
CLUSTER = vtrain.get_cluster_preset("dgx-a100")


@pytest.fixture(scope="module")
def process_groups(tmp_path_factory):
    """The process state of a training script: a default group and megatron-core's parallel state."""
    from megatron.core import parallel_state as ps

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ps.initialize_model_parallel()
    yield ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_traces(monkeypatch):
    """Every chunk is really traced (not read from a cache another test filled without groups up)."""
    clear_cache()
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")


@pytest.fixture(autouse=True)
def tracing_children_from_the_zygote(monkeypatch, python_m):
    """With the script's groups up, vtrain traces in a child process (``python -m
    vtrain_plugin.capture.child_trace``); here the child is forked from the tests' zygote (``python_m``)
    instead of started as a fresh interpreter: still a separate process, with no process group, running
    that module's entry point on the same request, without importing torch and megatron-core again for
    each trace. Its import path is the zygote's (the same vtrain and megatron-core); the fresh
    interpreter is run by test_trace_in_script_benchmark.py."""
    def run(command, *, input, env, **_):
        assert command[1:] == ["-m", child_trace.__name__]
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        env.update({k: v for k, v in os.environ.items() if k == "PYTHONPATH"})
        return python_m(child_trace.__name__, env=env, input=input)
    monkeypatch.setattr(child_trace, "subprocess", SimpleNamespace(run=run))


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                       use_cpu_initialization=True), **fields})


def _llama_fields():
    return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, num_query_groups=2,
                ffn_hidden_size=176)


def _gpt_model(config, **kwargs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization=config.normalization)
    return GPTModel(config=config, transformer_layer_spec=layer, vocab_size=VOCAB, max_sequence_length=SEQ, **kwargs)


def _tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _assert_process_left_as_found(ps, model, state, excepthook):
    """The script's groups still work, megatron-core's parallel state is the script's, and neither
    the model nor the torch functions vtrain patches while tracing were changed."""
    assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() == 1
    for group in (None, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()):
        ones = torch.ones(4)
        dist.all_reduce(ones, group=group)
        assert ones.tolist() == [1.0] * 4
    assert all(torch.equal(t, state[name]) for name, t in _state(model).items())
    assert torch.cuda.current_device is _CUDA_CURRENT_DEVICE and torch.Tensor.cuda is _TENSOR_CUDA
    assert sys.excepthook is excepthook


_CUDA_CURRENT_DEVICE, _TENSOR_CUDA = torch.cuda.current_device, torch.Tensor.cuda


def _state(model):
    modules = model if isinstance(model, list) else [model] if isinstance(model, torch.nn.Module) else []
    return {f"{i}.{name}": t for i, m in enumerate(modules) for name, t in m.state_dict().items() if t is not None}


def _traced_in_script(ps, model, *args, **kwargs):
    state = {name: t.clone() for name, t in _state(model).items()}
    excepthook = sys.excepthook
    graph = vtrain.trace(model, *args, **kwargs)
    _assert_process_left_as_found(ps, model, state, excepthook)
    return graph


def test_a_built_gpt_model_is_traced_and_estimated_for_another_plan_inside_a_training_script(process_groups):
    model = _gpt_model(_config())
    own = _traced_in_script(process_groups, model, sample_input=_tokens())
    assert own.model == vtrain.ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ,
                                         vocab_size=VOCAB, ffn_hidden_size=256, num_query_groups=4,
                                         tied_embeddings=False, dtype="fp32")
    assert (own.parallel.world_size, own.micro_batch_size) == (1, BATCH)
    # vtrain's rebuild of the model is the model the script built, parameter for parameter
    assert own.stages[0].num_parameters == sum(p.numel() for p in model.parameters())

    plan = vtrain.ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    wrapped = [torch.nn.parallel.DistributedDataParallel(model)]  # a script's wrapped list of model chunks
    graph = _traced_in_script(process_groups, wrapped, plan, sample_input=_tokens())
    assert graph.parallel == vtrain.ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=2,
                                                 micro_batch_size=BATCH)
    layer = graph.stages[0].layer_template()
    tp = [c for c in layer.collectives(Phase.FORWARD) if c.group is ParallelGroup.TP]
    assert tp and all(c.group_size == 2 for c in tp)
    est = vtrain.estimate(graph, cluster=CLUSTER, training=vtrain.TrainingSpec(global_batch_size=16))
    assert est.num_gpus == 8 and est.num_microbatches == 4
    assert est.iteration_time_ms > 0 and est.tokens_per_second == pytest.approx(
        16 * SEQ / (est.iteration_time_ms / 1000), rel=1e-12)


def test_a_llama_style_model_is_traced_inside_a_training_script(process_groups):
    model = _gpt_model(_config(**_llama_fields()), position_embedding_type="rope")
    graph = _traced_in_script(process_groups, model, sample_input=(_tokens(),))
    assert graph.model.family is Family.LLAMA and graph.model.num_query_groups == 2
    assert graph.stages[0].num_parameters == sum(p.numel() for p in model.parameters())
    est = vtrain.estimate(_traced_in_script(process_groups, model, vtrain.ParallelPlan(tensor_parallel=2),
                                           sample_input=_tokens()),
                          cluster=CLUSTER, training=vtrain.TrainingSpec(global_batch_size=4))
    assert est.num_microbatches == 2 and est.iteration_time_ms > 0


def test_a_moe_model_is_traced_inside_a_training_script(process_groups):
    """Mixtral-style: Llama layers with experts, megatron-core's default (all-gather) token dispatcher."""
    model = _gpt_model(_config(**_llama_fields(), num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128),
                       position_embedding_type="rope")
    graph = _traced_in_script(process_groups, model, sample_input=_tokens())
    assert (graph.model.num_experts, graph.model.router_topk) == (4, 2)
    assert graph.stages[0].num_parameters == sum(p.numel() for p in model.parameters())
    plan = vtrain.ParallelPlan(data_parallel=2, expert_parallel=2, moe_token_dispatcher="allgather")
    est = vtrain.estimate(_traced_in_script(process_groups, model, plan, sample_input=_tokens()),
                          cluster=CLUSTER, training=vtrain.TrainingSpec(global_batch_size=8))
    assert est.num_microbatches == 2 and est.iteration_time_ms > 0


def test_a_transformer_config_is_traced_inside_a_training_script(process_groups):
    config = _config(**_llama_fields(), tensor_model_parallel_size=2)
    graph = _traced_in_script(process_groups, config, vocab_size=VOCAB, seq_length=SEQ)
    assert graph.parallel == vtrain.ParallelPlan(tensor_parallel=2) and graph.model.family is Family.LLAMA


class HoldsItsGroup(torch.nn.Module):
    """A module that keeps a process group, as megatron-core's layers do: it cannot be deep-copied."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def test_a_plain_module_that_holds_a_process_group_is_traced(process_groups):
    module = HoldsItsGroup(process_groups.get_tensor_model_parallel_group())
    graph = _traced_in_script(process_groups, module, sample_input=torch.randn(4, 8))
    assert graph.stages[0].num_parameters == 8 * 8 + 8
    assert module.fc.weight.device.type == "cpu" and module.fc.weight.grad is None


@pytest.mark.parametrize("build, kwargs, message", [
    (lambda: _gpt_model(_config()), dict(sample_input=torch.randn(2, SEQ)),
     "sample_input of a megatron-core GPTModel must be its input_ids"),
    (lambda: _gpt_model(_config()), dict(sample_input=torch.zeros(2, SEQ, dtype=torch.long), seq_length=64),
     "seq_length (64) != the sample input's (32)"),
    (lambda: _gpt_model(_config()), {}, "tracing a megatron-core GPTModel needs sample_input="),
    (lambda: _gpt_model(_config(fp32_residual_connection=True)), dict(seq_length=SEQ),
     "TransformerConfig.fp32_residual_connection=True: a residual stream in fp32 is not modelled by vtrain yet"),
])
def test_a_gpt_model_vtrain_cannot_trace_is_refused_in_one_line(process_groups, build, kwargs, message):
    with pytest.raises(vtrain.ConfigError) as err:
        vtrain.trace(build(), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_validating_inside_a_training_script_is_refused_in_one_line(process_groups):
    """validate's one-device training builds on a fake process group of its own: it says where to run."""
    from megatron_adapters.real_model import train

    model = vtrain.ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB)
    with pytest.raises(vtrain.ConfigError, match=r"^validate trains on a fake process group of its own and cannot "
                                                 r"while this process's torch.distributed is initialized"):
        train(model, vtrain.ParallelPlan(), num_microbatches=1, iterations=1, warmup=0)
    assert dist.is_initialized() and process_groups.model_parallel_is_initialized()
