"""The one training step (megatron_adapters.training_step) against torch's AdamW and gradient clipping,
on small real CPU models, and under FakeTensorMode as the tracer runs it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from megatron_adapters.training_step import (FP16_LOSS_SCALE, AdamSettings, MicroBatch, MixedPrecisionAdamW,
                                             assume_finite, forward_backward, micro_batch_loss)
from vtrain_plugin.core.errors import ConfigError

B, S, H, V = 2, 3, 8, 5


class _TinyLM(torch.nn.Module):
    """Two nn.Linear layers called as megatron-core's GPTModel is: the per-token loss given labels."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(H, 16, dtype=dtype)
        self.fc2 = torch.nn.Linear(16, V, dtype=dtype)

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        logits = self.fc2(torch.relu(self.fc1(tokens)))
        return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")


def _batch(seed: int, dtype: torch.dtype) -> MicroBatch:
    generator = torch.Generator().manual_seed(seed)
    return MicroBatch(tokens=torch.randn(B, S, H, generator=generator).to(dtype),
                      attention_mask=torch.ones(1, 1, S, S, dtype=torch.bool),
                      labels=torch.randint(0, V, (B, S), generator=generator),
                      loss_mask=torch.ones(B, S))


def _torch_adamw(params, settings: AdamSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                             weight_decay=settings.weight_decay, foreach=False)


def _torch_step(params, grads, adamw: torch.optim.AdamW, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ then AdamW, as real training did before the one step; returns the total norm."""
    for p, g in zip(params, grads):
        p.grad = g
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    adamw.step()
    adamw.zero_grad(set_to_none=True)
    return total


def _assert_close(actual, expected, *, exact: bool) -> None:
    """Equal, or within 1e-6 of each tensor's L2 norm (an element near zero may differ by more, relative to itself)."""
    for a, e in zip(actual, expected, strict=True):
        if exact:
            assert torch.equal(a, e)
        else:
            assert torch.linalg.vector_norm(a - e) <= 1e-6 * torch.linalg.vector_norm(e)


@pytest.mark.parametrize("clip_grad", [1e3, 1e-2], ids=["unclipped", "clipped"])
def test_fp32_step_is_torch_adamw_after_clip_grad_norm(clip_grad):
    torch.manual_seed(0)
    model = _TinyLM(torch.float32)
    reference = copy.deepcopy(model)
    settings = AdamSettings(lr=1e-2, clip_grad=clip_grad)
    optimizer = MixedPrecisionAdamW(model.parameters(), settings)
    adamw = _torch_adamw(list(reference.parameters()), settings)
    for step in range(3):
        batch = _batch(step, torch.float32)
        forward_backward(model, batch, num_microbatches=1, loss_scale=optimizer.loss_scale)
        forward_backward(reference, batch, num_microbatches=1, loss_scale=1.0)
        total = _torch_step(list(reference.parameters()), [p.grad for p in reference.parameters()], adamw, clip_grad)
        assert (total > clip_grad) == (clip_grad < 1)
        assert optimizer.step()
    exact = clip_grad > 1  # clipped, the total norm differs from torch's in rounding (see _clip)
    _assert_close(model.parameters(), reference.parameters(), exact=exact)
    _assert_close(optimizer.exp_avg, [adamw.state[p]["exp_avg"] for p in reference.parameters()], exact=exact)
    _assert_close(optimizer.exp_avg_sq, [adamw.state[p]["exp_avg_sq"] for p in reference.parameters()], exact=exact)
    assert optimizer.steps == 3 and optimizer.main_params == optimizer.params
    assert all(p.grad is None for p in model.parameters())


def test_bf16_main_weights_are_torch_adamw_on_fp32_copies():
    torch.manual_seed(1)
    model = _TinyLM(torch.bfloat16)
    settings = AdamSettings(lr=1e-2)
    optimizer = MixedPrecisionAdamW(model.parameters(), settings)
    reference = [p.detach().float().clone() for p in model.parameters()]
    adamw = _torch_adamw(reference, settings)
    assert optimizer.loss_scale == 1.0
    for step in range(3):
        forward_backward(model, _batch(step, torch.bfloat16), num_microbatches=1, loss_scale=optimizer.loss_scale)
        grads = [p.grad.float() for p in model.parameters()]
        _torch_step(reference, grads, adamw, settings.clip_grad)
        assert optimizer.step()
    _assert_close(optimizer.main_params, reference, exact=False)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), optimizer.main_params))


def test_fp16_gradients_are_unscaled_before_torch_adamw():
    model = torch.nn.Linear(4, 3, dtype=torch.float16)
    optimizer = MixedPrecisionAdamW(model.parameters())
    reference = [p.detach().float().clone() for p in model.parameters()]
    adamw = _torch_adamw(reference, AdamSettings())
    assert optimizer.loss_scale == FP16_LOSS_SCALE
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for p in model.parameters():  # scaled gradients of norm well under 1: no clipping
            p.grad = (torch.randn(p.shape, generator=generator) * 1e-2 * FP16_LOSS_SCALE).half()
        grads = [p.grad.float() / FP16_LOSS_SCALE for p in model.parameters()]
        _torch_step(reference, grads, adamw, 1.0)
        assert optimizer.step()
    _assert_close(optimizer.main_params, reference, exact=True)


def test_clipping_scales_the_gradients_to_max_norm():
    torch.manual_seed(2)
    model = _TinyLM(torch.float32)
    settings = AdamSettings(clip_grad=1e-3)
    optimizer = MixedPrecisionAdamW(model.parameters(), settings)
    forward_backward(model, _batch(0, torch.float32), num_microbatches=1, loss_scale=1.0)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for c, p in zip(copies, model.parameters()):
        c.grad = p.grad.clone()
    total = torch.nn.utils.clip_grad_norm_(copies, settings.clip_grad, foreach=False)
    assert total > 100 * settings.clip_grad
    assert optimizer.step()
    # After the first step exp_avg = (1 - beta1) * the clipped gradient.
    expected = [torch.zeros_like(c).lerp_(c.grad, 1 - settings.beta1) for c in copies]
    _assert_close(optimizer.exp_avg, expected, exact=False)
    gradients = [m / (1 - settings.beta1) for m in optimizer.exp_avg]
    norm = math.sqrt(sum(torch.linalg.vector_norm(g).item() ** 2 for g in gradients))
    assert norm == pytest.approx(settings.clip_grad, rel=1e-5)


def test_fp16_step_with_an_inf_gradient_is_skipped():
    model = torch.nn.Linear(4, 3, dtype=torch.float16)
    optimizer = MixedPrecisionAdamW(model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    main = [m.clone() for m in optimizer.main_params]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.weight.grad[1, 2] = math.inf
    assert not optimizer.step()
    assert optimizer.steps == 0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(m, before) for m, before in zip(optimizer.main_params, main))
    assert all(not m.any() for m in (*optimizer.exp_avg, *optimizer.exp_avg_sq))
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():  # the found-inf flag was reset: the next finite step is taken
        p.grad = torch.ones_like(p)
    assert optimizer.step() and optimizer.steps == 1
    assert not any(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_step_runs_under_fake_tensor_mode():
    with FakeTensorMode():
        model = _TinyLM(torch.float16)
        optimizer = MixedPrecisionAdamW(model.parameters(), found_inf=assume_finite)
        loss = forward_backward(model, _batch(0, torch.float16), num_microbatches=2, loss_scale=optimizer.loss_scale)
        assert optimizer.step()
    assert isinstance(loss, FakeTensor) and all(isinstance(m, FakeTensor) for m in optimizer.main_params)
    assert optimizer.steps == 1


def test_loss_is_the_masked_mean_divided_by_micro_batches_then_scaled():
    output = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    loss, scaled = micro_batch_loss(output, mask, num_microbatches=4, loss_scale=FP16_LOSS_SCALE)
    assert loss.item() == pytest.approx(7 / 3, rel=1e-6)
    assert scaled.item() == loss.item() / 4 * FP16_LOSS_SCALE
    with pytest.raises(ConfigError, match="num_microbatches must be a positive integer, got 0"):
        micro_batch_loss(output, mask, num_microbatches=0, loss_scale=1.0)


def test_invalid_adam_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"adam\.beta2 must be in \[0, 1\), got 1.0"):
        AdamSettings(beta2=1.0)
    with pytest.raises(ConfigError, match="adam.clip_grad must be a positive finite gradient norm"):
        AdamSettings(clip_grad=0.0)
    assert AdamSettings() == AdamSettings(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=1.0)
