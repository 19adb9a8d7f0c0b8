"""Megatron-LM's switches of Megatron's jit-fused kernels, read into ``training.unfused_kernels``, and
where a switch changes nothing on a stack, why (``vtrain flags`` shows it).

Megatron-LM sets TransformerConfig's ``bias_activation_fusion`` from ``--no-bias-swiglu-fusion`` with
``--swiglu`` and from ``--no-bias-gelu-fusion`` otherwise, ``bias_dropout_fusion``,
``apply_rope_fusion`` and ``masked_softmax_fusion`` from their ``--no-...`` switch; the stacks'
lowerings then keep those ops unfused, as traced. With ``--use-te-activation-func`` megatron-core's MLP
(megatron/core/transformer/mlp.py) runs the activation before asking for the bias-activation fusion:
TransformerEngine's activation op (one kernel each way) in TE's layer spec, the config's activation
eagerly in the local spec, whose spec has no TE op. The softmax and norm switches that
TransformerEngine ignores, or that set a value inside the same fused kernel, are accepted as changing
nothing there. ``--disable-jit-fuser`` stays a second-order effect: the ``@jit_fuser`` functions then
run their bodies eagerly (bias-GeLU's tanh formula as several kernels), which no traced op matches.

Why: the functional tests give these switches in most runs; read as second-order effects they warned
on every one, and the fused kernels they turn off were costed as if still on.
"""

from __future__ import annotations

from typing import Any

Given = dict[str, Any]

# The switch turning each fusion off (training.unfused_kernels names); the bias-activation one by --swiglu.
_SWITCHES = (("--no-bias-dropout-fusion", "bias_dropout"), ("--no-rope-fusion", "rope"),
             ("--no-masked-softmax-fusion", "masked_softmax"))
_GELU, _SWIGLU = "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion"
_TE_ACTIVATION = "--use-te-activation-func"
_TE, _LOCAL = "megatron_core_te", "megatron_core_local"
_TE_ACTIVATION_WINS = f"with {_TE_ACTIVATION} (megatron-core's MLP runs that activation whatever the fusion)"
_FUSED_SOFTMAX = "a value inside Megatron's fused masked softmax, which computes in fp32 whatever the setting"

# flag -> ((stack, why it changes nothing there), ...); "any" for every stack.
NO_EFFECT: dict[str, tuple[tuple[str, str], ...]] = {
    "--attention-softmax-in-fp32": (
        (_TE, "TransformerEngine's attention (fused or unfused) takes no softmax dtype from megatron-core"),
        (_LOCAL, f"{_FUSED_SOFTMAX}; with --no-masked-softmax-fusion the softmax is costed in fp32, as traced")),
    "--apply-query-key-layer-scaling": (
        (_TE, "a scale inside TransformerEngine's attention kernel (NVTE_APPLY_QK_LAYER_SCALING)"),
        (_LOCAL, _FUSED_SOFTMAX)),
    "--no-masked-softmax-fusion": (
        (_TE, "TransformerEngine's attention runs its own softmax whatever the setting"),),
    "--no-persist-layer-norm": (
        (_TE, "TransformerEngine's norms (TENorm, LayerNormLinear) ignore persist_layer_norm"),
        (_LOCAL, "apex's persistent and plain fused LayerNorm are one kernel each way over the same bytes")),
    _GELU: (("any", "with --swiglu (Megatron-LM's bias-activation fusion follows --no-bias-swiglu-fusion), or "
                    "with --disable-bias-linear (Megatron-LM turns the bias-GeLU fusion off without a bias)"),
            ("any", _TE_ACTIVATION_WINS)),
    _SWIGLU: (("any", "without --swiglu (Megatron-LM's bias-activation fusion follows --no-bias-gelu-fusion)"),
              ("any", _TE_ACTIVATION_WINS)),
}
# What of a modelled flag is costed otherwise than Megatron runs it (``vtrain flags`` shows it).
FLAG_NOTES = {_TE_ACTIVATION: "on megatron_core_te a linear bias is added apart, an elementwise add costed inside the "
                              "fused activation; on megatron_core_local the activation runs unfused"}


def unfused_kernels(given: Given) -> tuple[str, ...]:
    """The fusions the command line turns off (``training.unfused_kernels``), as Megatron-LM sets them;
    with ``--use-te-activation-func``, the bias-activation fusion as megatron-core's MLP then runs it."""
    off = [name for flag, name in _SWITCHES if given.get(flag)]
    if given.get(_TE_ACTIVATION):
        if given.get("--transformer-impl") == "local":  # the local spec's MLP has no TE activation op
            off.append("bias_activation")
    elif given.get(_SWIGLU if given.get("--swiglu") else _GELU):
        off.append("bias_activation")
    return tuple(sorted(off))


def no_effect_notes(flag: str) -> tuple[str, ...]:
    """Where ``flag`` changes nothing, one line per stack (none for a flag that always does)."""
    return tuple(f"no effect on {stack}: {why}" if stack != "any" else f"no effect {why}"
                 for stack, why in NO_EFFECT.get(flag, ()))
