"""The one training step of a model chunk, run by the tracer and by real training alike.

``megatron_adapters.gpt.run_training_step`` records it under FakeTensorMode for the estimate and
``megatron_adapters.real_model.train`` times it on a device for ``vtrain validate``, so the
validation measures the step the estimate costs. An iteration is ``num_microbatches`` calls of
:func:`forward_backward` (gradients accumulate in the model weights' ``.grad``), then one
:meth:`MixedPrecisionAdamW.step`; the tracer records one micro-batch and the step.

Everything here runs on real and on fake tensors: no op reads a tensor's value on the host, except
the fp16 found-inf decision, which the caller injects (see :class:`MixedPrecisionAdamW`). The
caller also provides the contexts each part runs in (:class:`StepScopes`): the tracer's phase and
module attribution, nothing for real training.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from vtrain_plugin.core.errors import ConfigError

FP16_LOSS_SCALE = 4096.0
"""Megatron's static loss scale for fp16 models (bf16 and fp32 need none)."""

_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class AdamSettings:
    """Megatron's defaults: AdamW, loss scaling for fp16, gradient clipping at 1.0."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"adam.lr must be positive, got {self.lr!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"adam.{name} must be in [0, 1), got {value!r}")
        if not self.eps >= 0:
            raise ConfigError(f"adam.eps must be non-negative, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"adam.weight_decay must be non-negative, got {self.weight_decay!r}")
        if not (self.clip_grad > 0 and math.isfinite(self.clip_grad)):
            raise ConfigError(f"adam.clip_grad must be a positive finite gradient norm, got {self.clip_grad!r}")


Scope = Callable[[], AbstractContextManager]


def _no_parameter_scope(param: torch.nn.Parameter) -> AbstractContextManager:
    return contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class StepScopes:
    """Contexts the parts of a step run in; all empty by default (real training).

    ``parameter`` wraps the optimizer's work on one parameter (gradient cast, unscale, its norm
    added to the squared total, clip scaling, Adam update, copy back to the model weight);
    ``global_ops`` wraps the few scalar ops that span all parameters (resetting the fp16 found-inf
    flag and the squared total norm, the total norm and the clip coefficient).
    """

    forward: Scope = contextlib.nullcontext
    loss: Scope = contextlib.nullcontext
    backward: Scope = contextlib.nullcontext
    optimizer: Scope = contextlib.nullcontext
    parameter: Callable[[torch.nn.Parameter], AbstractContextManager] = _no_parameter_scope
    global_ops: Scope = contextlib.nullcontext


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """The inputs of one micro-batch on one pipeline stage.

    ``tokens`` and ``position_ids`` are None on a stage without the embedding (its input was set
    with ``set_input_tensor``). The last stage has ``labels`` and ``loss_mask`` and back-propagates
    its loss; every other stage back-propagates ``output_grad``, the gradient of its output that
    the next stage sends back.
    """

    attention_mask: torch.Tensor
    tokens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.labels is None) != (self.loss_mask is None):
            raise ValueError("a micro-batch has labels and loss_mask together or neither")
        if (self.labels is None) == (self.output_grad is None):
            raise ValueError("a micro-batch has labels (last stage) or output_grad (other stages), exactly one")


def micro_batch_loss(output: torch.Tensor, loss_mask: torch.Tensor, *, num_microbatches: int,
                     loss_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch, and what backward starts from.

    ``output`` is the per-token loss. The loss is its mean over ``loss_mask``; backward starts from
    it divided by ``num_microbatches`` (Megatron's forward step, so accumulated gradients are those
    of the mean loss over the iteration) times ``loss_scale`` (Megatron scales the loss for fp16).
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    scaled = loss / num_microbatches
    if loss_scale != 1.0:
        scaled = scaled * loss_scale
    return loss, scaled


def forward_backward(model: torch.nn.Module, batch: MicroBatch, *, num_microbatches: int, loss_scale: float,
                     scopes: StepScopes = StepScopes()) -> torch.Tensor | None:
    """Forward and backward of one micro-batch, accumulating into the weights' ``.grad``.

    ``model`` is called as megatron-core's GPTModel is (returning the per-token loss given labels).
    Returns the micro-batch's loss on the last stage, None elsewhere. The loss is not detached
    (detaching is an op the tracer would record); backward has freed its graph.
    """
    loss = scaled = None
    with scopes.forward():
        output = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        if batch.labels is not None:
            with scopes.loss():
                loss, scaled = micro_batch_loss(output, batch.loss_mask, num_microbatches=num_microbatches,
                                                loss_scale=loss_scale)
    with scopes.backward():
        if scaled is None:
            torch.autograd.backward(output, batch.output_grad)
        else:
            torch.autograd.backward(scaled)
    return loss


FoundInf = Callable[[torch.Tensor], bool]


def read_found_inf(found_inf: torch.Tensor) -> bool:
    """Real training: whether the unscale found an inf or NaN (a host sync, as in Megatron)."""
    return bool(found_inf.item())


def assume_finite(found_inf: torch.Tensor) -> bool:
    """Tracing: a fake tensor has no value to read; the traced step is one whose gradients are finite."""
    return False


class MixedPrecisionAdamW:
    """Megatron's mixed-precision AdamW with gradient clipping, written out op by op.

    The math is ``torch.optim.AdamW(foreach=False)`` (``torch.optim.adam._single_tensor_adam`` with
    decoupled weight decay: bias correction, ``denom = sqrt(v) / sqrt(1 - beta2^t) + eps``) after
    ``torch.nn.utils.clip_grad_norm_(foreach=False)`` (per-tensor L2 norms, their L2 norm as the
    total, gradients times ``min(max_norm / (total + 1e-6), 1)``; see :meth:`_clip` for the one
    difference, in rounding). For fp16 and bf16 models it runs on fp32 main weights and copies them
    back to the model weights; for fp32 models on the weights themselves.

    A step, in Megatron's order: each model gradient cast to an fp32 main gradient (one ``_to_copy``
    per parameter; the model gradient is released, as ``zero_grad(set_to_none=True)`` would, so
    the next iteration accumulates from zero); for fp16, the unscale by ``1 / FP16_LOSS_SCALE``
    with the found-inf check, and the step is skipped when ``found_inf(flag)`` says so; the
    per-parameter norms (each added to the squared total); the total norm and clip coefficient;
    the clip scaling; the AdamW update; the copy to the model weights.

    ``found_inf`` decides from the found-inf flag tensor whether to skip: real training passes
    :func:`read_found_inf` (the default), tracing :func:`assume_finite`, since a fake tensor has no
    value. The step count is a Python int and nothing else reads a tensor on the host, so the
    step runs under FakeTensorMode. State (main weights, moments, the flag, the squared-norm
    accumulator) is created here, once, outside any step.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], settings: AdamSettings = AdamSettings(), *,
                 found_inf: FoundInf = read_found_inf) -> None:
        self.params = tuple(p for p in params if p.requires_grad)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _MODEL_DTYPES:
            raise ValueError(f"the optimizer needs trainable parameters of one dtype among "
                             f"{', '.join(map(str, _MODEL_DTYPES))}; got {sorted(map(str, dtypes))}")
        self.model_dtype = next(iter(dtypes))
        self.settings = settings
        self.steps = 0
        self._found_inf_decision = found_inf
        self.loss_scale = FP16_LOSS_SCALE if self.model_dtype is torch.float16 else 1.0
        with torch.no_grad():
            self.main_params = (self.params if self.model_dtype is torch.float32
                                else tuple(p.detach().to(torch.float32, copy=True) for p in self.params))
            self.exp_avg = tuple(torch.zeros_like(m, memory_format=torch.preserve_format) for m in self.main_params)
            self.exp_avg_sq = tuple(torch.zeros_like(m, memory_format=torch.preserve_format)
                                    for m in self.main_params)
            device = self.params[0].device
            self._norm_sq = torch.zeros((), dtype=torch.float32, device=device)
            self._unscale = None
            if self.model_dtype is torch.float16:  # the found-inf flag and the inverse loss scale
                self._unscale = (torch.zeros(1, dtype=torch.float32, device=device),
                                 torch.full((1,), 1 / self.loss_scale, dtype=torch.float32, device=device))

    @property
    def mixed_precision(self) -> bool:
        return self.model_dtype is not torch.float32

    def step(self, scopes: StepScopes = StepScopes()) -> bool:
        """One optimizer step from the accumulated gradients; False if skipped for an inf/NaN (fp16)."""
        with torch.no_grad(), scopes.optimizer():
            grads = self._take_main_grads(scopes)
            if self._unscale is not None and self._unscale_found_inf(grads, scopes):
                return False
            self._clip(grads, scopes)
            self.steps += 1
            self._adamw(grads, scopes)
            if self.mixed_precision:
                for p, main in zip(self.params, self.main_params):
                    with scopes.parameter(p):
                        p.copy_(main)
        return True

    def _take_main_grads(self, scopes: StepScopes) -> list[torch.Tensor]:
        grads = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                raise RuntimeError(f"parameter {i} of {len(self.params)} ({tuple(p.shape)}) has no gradient; "
                                   f"every trainable parameter must take part in the step")
            with scopes.parameter(p):
                grads.append(p.grad.float() if self.mixed_precision else p.grad)
            p.grad = None
        return grads

    def _unscale_found_inf(self, grads: list[torch.Tensor], scopes: StepScopes) -> bool:
        found_inf, inv_scale = self._unscale
        with scopes.global_ops():
            found_inf.zero_()
        for p, g in zip(self.params, grads):
            with scopes.parameter(p):
                torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv_scale)
        return self._found_inf_decision(found_inf)

    def _clip(self, grads: list[torch.Tensor], scopes: StepScopes) -> None:
        """``clip_grad_norm_(foreach=False)``'s clipping, the total norm summed parameter by parameter.

        torch takes the norm of the stacked per-parameter norms; that one op's shape grows with the
        number of parameters, so a trace of two layers would not stand for a chunk of any depth.
        Here each parameter adds its squared norm to a scalar, and the global ops are scalar: the
        total norm then differs from torch's in rounding only (a few fp32 ulps), and the gradients
        are the same as torch's whenever they are not clipped.
        """
        with scopes.global_ops():
            self._norm_sq.zero_()
        for p, g in zip(self.params, grads):
            with scopes.parameter(p):
                norm = torch.linalg.vector_norm(g, 2.0)
                self._norm_sq.addcmul_(norm, norm)
        with scopes.global_ops():
            total = self._norm_sq.sqrt()
            clip_coef = torch.clamp(float(self.settings.clip_grad) / (total + 1e-6), max=1.0)
        for p, g in zip(self.params, grads):
            with scopes.parameter(p):
                g.mul_(clip_coef)

    def _adamw(self, grads: list[torch.Tensor], scopes: StepScopes) -> None:
        """``_single_tensor_adam`` with decoupled weight decay, not capturable: the bias corrections
        are Python floats of the step count."""
        s = self.settings
        step_size = s.lr / (1 - s.beta1 ** self.steps)
        bias_correction2_sqrt = (1 - s.beta2 ** self.steps) ** 0.5
        for p, main, g, exp_avg, exp_avg_sq in zip(self.params, self.main_params, grads, self.exp_avg,
                                                    self.exp_avg_sq):
            with scopes.parameter(p):
                if s.weight_decay != 0:
                    main.mul_(1 - s.lr * s.weight_decay)
                exp_avg.lerp_(g, 1 - s.beta1)
                exp_avg_sq.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(s.eps)
                main.addcdiv_(exp_avg, denom, value=-step_size)
