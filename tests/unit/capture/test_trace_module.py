"""Tracing a plain torch.nn.Module on the meta device."""

import pytest
import torch

from vtrain_plugin.core.graph import Phase
from vtrain_plugin.capture.tracer import trace


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_plain_module_is_traced_with_modules_and_phases():
    graph = trace(TwoLayer(), sample_input=torch.randn(8, 32))
    (stage,) = graph.stages
    ops = list(stage.blocks[0].ops())
    forward = [(op.op, op.module) for op in ops if op.phase is Phase.FORWARD]
    assert ("aten.addmm.default", "fc1") in forward and ("aten.addmm.default", "fc2") in forward
    backward_mm = [op for op in ops if op.phase is Phase.BACKWARD and op.op == "aten.mm.default"]
    assert {op.module for op in backward_mm} == {"fc1", "fc2"}
    assert any(op.phase is Phase.OPTIMIZER for op in ops)
    assert stage.num_parameters == 32 * 64 + 64 + 64 * 16 + 16
    # 2*M*N*K per GEMM; forward + two backward GEMMs for fc2, forward + weight-grad for fc1
    assert graph.flops(Phase.FORWARD) == 2 * 8 * (32 * 64 + 64 * 16)
    assert graph.micro_batch_size == 8


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 32)
        self.head = torch.nn.Linear(32, 100)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def test_sample_batch_is_one_micro_batch_and_tokens_per_second_is_reported():
    """Regression: a sample batch of 8 with a global batch of 8 was counted as 8 micro-batches and
    the estimate reported 0 tokens/s."""
    from vtrain_plugin.estimate import estimate
    from vtrain_plugin.hardware.clusters import get_cluster_preset
    from vtrain_plugin.specs.training import TrainingSpec

    cluster = get_cluster_preset("dgx-a100")
    token_graph = trace(TinyLM(), sample_input=torch.zeros(8, 128, dtype=torch.long))
    assert (token_graph.parallel.micro_batch_size, token_graph.seq_length) == (8, 128)
    est = estimate(token_graph, cluster=cluster, training=TrainingSpec(global_batch_size=16))
    assert est.num_microbatches == 2
    assert est.tokens_per_second == pytest.approx(16 * 128 / (est.iteration_time_ms / 1000), rel=1e-12)

    dense = trace(TwoLayer(), sample_input=torch.randn(8, 32))
    assert estimate(dense, cluster=cluster, training=TrainingSpec(global_batch_size=8)).tokens_per_second is None
    stated = trace(TwoLayer(), sample_input=torch.randn(8, 32), seq_length=4)
    assert estimate(stated, cluster=cluster, training=TrainingSpec(global_batch_size=8)).tokens_per_second > 0


def test_what_trace_cannot_take_is_refused_in_one_line():
    from vtrain_plugin.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model must be a ModelSpec, a megatron-core TransformerConfig or "
                                          r"GPTModel, or a torch.nn.Module; got str$"):
        trace("gpt3-175b", vocab_size=51200, seq_length=2048)


def test_the_traced_module_is_run_with_meta_stand_ins_and_left_as_it_was():
    """Regression: the module was deep-copied first, which fails on one that holds what cannot be
    copied (megatron-core layers hold their process groups)."""
    import threading

    class HoldsALock(TwoLayer):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()  # copy.deepcopy: "cannot pickle '_thread.lock' object"

    module = HoldsALock()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    graph = trace(module, sample_input=torch.randn(8, 32))
    assert graph.stages[0].num_parameters == 32 * 64 + 64 + 64 * 16 + 16
    assert all(torch.equal(t, before[name]) for name, t in module.state_dict().items())
    assert all(p.device.type == "cpu" and p.grad is None for p in module.parameters())
    assert not module._forward_hooks and not module.fc1._forward_pre_hooks


def test_tied_weights_stay_tied_and_are_counted_once():
    module = TinyLM()
    module.head.weight = module.embed.weight
    graph = trace(module, sample_input=torch.zeros(2, 16, dtype=torch.long))
    assert graph.stages[0].num_parameters == 100 * 32 + 100
    optimizer = [op for op in graph.stages[0].blocks[0].ops() if op.phase is Phase.OPTIMIZER]
    assert sorted(op.output_shapes for op in optimizer if op.op == "aten.sqrt.default") == [((100,),), ((100, 32),)]
