"""The model shapes compute-optimal sizing chooses among, Chinchilla's token count, and the
fixed-MFU answer (:func:`naive_size`) that a searched answer is compared with.

**Shapes.** One rule for GPT and Llama, so that a family is a ladder of hidden sizes:

- head dimension :data:`HEAD_DIM` = 128, so ``num_attention_heads = hidden_size / 128``;
- ``num_layers = hidden_size / HIDDEN_PER_LAYER`` with :data:`HIDDEN_PER_LAYER` = 128, the aspect
  ratio of the published shapes used as anchors: GPT-3 6.7B (4096 / 32), 13B (5140 / 40) and 175B
  (12288 / 96) (Brown et al. 2020, Table 2.1), Llama 7B (4096 / 32) and 13B (5120 / 40) (Touvron et
  al. 2023, Table 2). The ladder reproduces GPT-3 175B, Llama 7B and Llama 13B exactly. Kaplan et
  al. 2020 (section 3.1, Fig. 5) found the loss within a few percent across a wide range of aspect
  ratios at a fixed parameter count, so one ratio costs little;
- the FFN as :class:`ModelSpec` defaults it: 4h for GPT, Llama's SwiGLU 8h/3 rounded up to a
  multiple of 256 (each expert's, for a mixture of experts); GPT ties its embeddings, Llama does not;
- vocabulary, sequence length, query groups and dtype per family unless given
  (:data:`LADDER_DEFAULTS`): GPT 51200 / 2048 / multi-head attention / fp16 (GPT-3 as Megatron-LM
  trains it), Llama 128256 / 8192 / 8 query groups (GQA) / bf16 (Llama 3); dense unless a number of
  experts (and experts per token, default 2) is given.

Hidden sizes step by :data:`HIDDEN_STEP` = 1024 (any multiple of 128 may be asked for): heads and
layers are then multiples of 8, so tensor parallelism up to 8 divides the heads and pipeline
parallelism up to 8 the layers of every shape, and a plan search finds plans for each. Consecutive
shapes differ by ``((k + 1) / k)^3`` in parameters, 27% at GPT-3 175B's size.

Parameter counts are :attr:`ModelSpec.num_parameters`: the traced model's, embeddings and positions
included, with the vocabulary as given (the traced shards add Megatron's padding of the vocabulary
to a multiple of 128 x TP, which depends on the plan).

**Presets.** Named published shapes (:data:`MODEL_PRESETS`, :func:`model_preset`), for job files
that name a model instead of spelling it out: the GPT-3 family as Megatron-LM / Megatron-DeepSpeed
train it (Brown et al. 2020, Table 2.1; 1.3B with 16 heads and 13B with hidden size 5120, as the
Megatron-DeepSpeed example scripts have them, since the paper's 24 x 128 and 40 x 128 heads do not
divide 2048 and 5140), and Llama 2 7B, 13B and 70B (Touvron et al. 2023, Table 1; 70B with 8 key-value
groups and FFN 28672), each with its family's vocabulary, sequence length and dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import takewhile
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import SECONDS_PER_DAY
from vtrain_plugin.specs.model import DEFAULT_MOE_ROUTER_TOPK, Family, ModelSpec

HEAD_DIM = 128
HIDDEN_PER_LAYER = 128  # hidden size / layers: GPT-3 and Llama's published aspect ratio
HIDDEN_STEP = 1024  # heads and layers multiples of 8
# Hoffmann et al. 2022 (Chinchilla): compute-optimal training uses about 20 tokens per parameter
# (Table 3; Chinchilla itself: 70B parameters trained on 1.4T tokens).
CHINCHILLA_TOKENS_PER_PARAMETER = 20.0
# Kaplan et al. 2020, section 2.1: a dense transformer does about 2 FLOPs per parameter and token in
# the forward pass and 4 in the backward pass.
TRAINING_FLOPS_PER_PARAMETER_TOKEN = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyDefaults:
    vocab_size: int
    seq_length: int
    dtype: Dtype


# The presets' (GPT-3, Llama 2).
FAMILY_DEFAULTS = {
    Family.GPT: FamilyDefaults(vocab_size=51200, seq_length=2048, dtype=Dtype.FP16),
    Family.LLAMA: FamilyDefaults(vocab_size=32000, seq_length=4096, dtype=Dtype.BF16),
}
MHA = 0  # num_query_groups of the ladder: multi-head attention (one group per head)


@dataclass(frozen=True, slots=True, kw_only=True)
class LadderDefaults(FamilyDefaults):
    num_query_groups: int  # MHA: multi-head attention


# The ladder's: GPT-3 as Megatron-LM trains it, and today's Llama (Llama 3: vocabulary 128256,
# sequence 8192, 8 key-value groups).
LADDER_DEFAULTS = {
    Family.GPT: LadderDefaults(vocab_size=51200, seq_length=2048, dtype=Dtype.FP16, num_query_groups=MHA),
    Family.LLAMA: LadderDefaults(vocab_size=128256, seq_length=8192, dtype=Dtype.BF16, num_query_groups=8),
}


def describe_ladder(model: ModelSpec) -> str:
    """What every shape of ``model``'s ladder shares: vocabulary, sequence, attention, experts, dtype."""
    groups = model.num_query_groups
    attention = "multi-head attention" if groups is None else f"{groups} query groups (GQA)"
    experts = ("dense" if model.num_experts is None
               else f"{model.num_experts} experts, top-{model.router_topk} (MoE)")
    return (f"{model.family.value}, vocabulary {model.vocab_size:,}, sequence {model.seq_length:,}, "
            f"{attention}, {experts}, {model.dtype.value}")


def family_shape(family: Family | str, hidden_size: int, *, vocab_size: int | None = None,
                 seq_length: int | None = None, dtype: Dtype | str | None = None,
                 num_query_groups: int | None = None, num_experts: int | None = None,
                 moe_router_topk: int | None = None) -> ModelSpec:
    """The family's model of ``hidden_size`` (a multiple of :data:`HIDDEN_PER_LAYER`), see the module
    doc; a setting left None is the family's (:data:`LADDER_DEFAULTS`), ``num_query_groups``
    :data:`MHA` multi-head attention; ``moe_router_topk`` needs ``num_experts``."""
    family = _family(family)
    v.positive_int("hidden_size", hidden_size)
    if hidden_size % HIDDEN_PER_LAYER:
        raise ConfigError(f"hidden_size ({hidden_size}) must be a multiple of {HIDDEN_PER_LAYER}: "
                          f"head dim {HEAD_DIM}, {HIDDEN_PER_LAYER} hidden per layer")
    defaults = LADDER_DEFAULTS[family]
    groups = defaults.num_query_groups if num_query_groups is None else v.non_negative_int("num_query_groups",
                                                                                           num_query_groups)
    heads = hidden_size // HEAD_DIM
    if groups and heads % groups:
        raise ConfigError(f"num_query_groups ({groups}) must divide the heads of every shape: hidden size "
                          f"{hidden_size} has {heads} heads (hidden / {HEAD_DIM}); use a hidden step that is a "
                          f"multiple of {HEAD_DIM * groups} or fewer groups")
    if moe_router_topk is not None and num_experts is None:
        raise ConfigError("moe_router_topk needs num_experts (a mixture-of-experts ladder)")
    layers = hidden_size // HIDDEN_PER_LAYER
    moe = "" if num_experts is None else f"-e{num_experts}k{moe_router_topk or DEFAULT_MOE_ROUTER_TOPK}"
    return ModelSpec(family=family, num_layers=layers, hidden_size=hidden_size,
                     num_attention_heads=heads, num_query_groups=groups or None,
                     num_experts=num_experts, moe_router_topk=moe_router_topk,
                     seq_length=defaults.seq_length if seq_length is None else seq_length,
                     vocab_size=defaults.vocab_size if vocab_size is None else vocab_size,
                     dtype=defaults.dtype if dtype is None else dtype,
                     name=f"{family.value}-h{hidden_size}-l{layers}{moe}")


def family_shapes(family: Family | str, *, min_params: float, max_params: float, hidden_step: int = HIDDEN_STEP,
                  **settings: Any) -> list[ModelSpec]:
    """The family's shapes with ``min_params <= num_parameters <= max_params``, by parameter count
    (which grows with the hidden size); ``settings``: those of :func:`family_shape`."""
    low = v.positive_number("min_params", min_params)
    high = v.positive_number("max_params", max_params)
    if low > high:
        raise ConfigError(f"min_params ({min_params:g}) must not exceed max_params ({max_params:g})")
    ladder = _ladder(family, hidden_step, **settings)
    return [m for m in takewhile(lambda m: m.num_parameters <= high, ladder) if m.num_parameters >= low]


def _preset(family: Family, layers: int, hidden: int, heads: int, **extra) -> ModelSpec:
    d = FAMILY_DEFAULTS[family]
    return ModelSpec(family=family, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     seq_length=d.seq_length, vocab_size=d.vocab_size, dtype=d.dtype, **extra)


MODEL_PRESETS: dict[str, ModelSpec] = {
    "gpt3-1.3b": _preset(Family.GPT, 24, 2048, 16, name="gpt3-1.3b"),
    "gpt3-2.7b": _preset(Family.GPT, 32, 2560, 32, name="gpt3-2.7b"),
    "gpt3-6.7b": _preset(Family.GPT, 32, 4096, 32, name="gpt3-6.7b"),
    "gpt3-13b": _preset(Family.GPT, 40, 5120, 40, name="gpt3-13b"),
    "gpt3-175b": _preset(Family.GPT, 96, 12288, 96, name="gpt3-175b"),
    "llama2-7b": _preset(Family.LLAMA, 32, 4096, 32, name="llama2-7b"),
    "llama2-13b": _preset(Family.LLAMA, 40, 5120, 40, name="llama2-13b"),
    "llama2-70b": _preset(Family.LLAMA, 80, 8192, 64, num_query_groups=8, ffn_hidden_size=28672,
                          name="llama2-70b"),
}


def model_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (see the module doc); an unknown name lists the valid ones."""
    try:
        return MODEL_PRESETS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown model preset {name!r}; valid presets are {', '.join(MODEL_PRESETS)}") from None


def chinchilla_tokens(params: float, tokens_per_parameter: float = CHINCHILLA_TOKENS_PER_PARAMETER) -> float:
    """Compute-optimal training tokens of a model of ``params`` parameters (Hoffmann et al. 2022)."""
    return v.positive_number("params", params) * v.positive_number("tokens_per_parameter", tokens_per_parameter)


def training_flops(params: float, tokens: float) -> float:
    """``6 * N * D``: model FLOPs of training ``params`` parameters on ``tokens`` tokens. Attention's
    sequence-length term is left out, and so is activation recompute (which adds a forward pass,
    about 2ND more): these are model FLOPs, the quantity MFU is measured against."""
    return TRAINING_FLOPS_PER_PARAMETER_TOKEN * params * tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class NaiveSize:
    """The largest family shape whose Chinchilla-optimal training fits a FLOP budget at a fixed MFU."""

    model: ModelSpec
    tokens: float  # chinchilla_tokens of the model
    flops: float  # training_flops(num_parameters, tokens)
    budget_flops: float  # gpus * peak * mfu * days

    @property
    def num_parameters(self) -> int:
        return self.model.num_parameters


def naive_size(family: Family | str, *, peak_tflop_per_s: float, gpus: int, days: float, mfu: float = 0.5,
               tokens_per_parameter: float = CHINCHILLA_TOKENS_PER_PARAMETER, hidden_step: int = HIDDEN_STEP,
               **settings: Any) -> NaiveSize:
    """The "fixed MFU" answer: the largest shape whose ``6 * N * D`` FLOPs, ``D`` its Chinchilla
    tokens, fit ``gpus * peak_tflop_per_s * mfu * days``. ``peak_tflop_per_s`` is one GPU's dense
    tensor rate for the model dtype. It assumes every model trains at the same MFU whatever its
    shape and plan, which is what a searched plan replaces with its estimated iteration time."""
    v.positive_int("gpus", gpus)
    v.positive_number("peak_tflop_per_s", peak_tflop_per_s)
    v.positive_number("days", days)
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ConfigError(f"mfu must be a fraction in (0, 1], got {mfu!r}")
    budget = gpus * peak_tflop_per_s * 1e12 * mfu * days * SECONDS_PER_DAY
    best = None
    for model in _ladder(family, hidden_step, **settings):
        tokens = chinchilla_tokens(model.num_parameters, tokens_per_parameter)
        flops = training_flops(model.num_parameters, tokens)
        if flops > budget:
            break
        best = NaiveSize(model=model, tokens=tokens, flops=flops, budget_flops=budget)
    if best is None:  # the loop stopped at the smallest shape
        raise ConfigError(
            f"no {model.family.value} shape fits the budget: the smallest, {model.name} with "
            f"{model.num_parameters:,} parameters, needs 6 * N * D = {flops:.3g} FLOPs on {tokens:.3g} tokens; "
            f"gpus ({gpus}) * peak ({peak_tflop_per_s:g} TFLOP/s) * mfu ({mfu:g}) * days ({days:g}) "
            f"= {budget:.3g} FLOPs")
    return best


def _family(family: Family | str) -> Family:
    return Family(v.one_of("family", str(family), [f.value for f in Family]))


def _ladder(family: Family | str, hidden_step: int, **settings: Any) -> Iterator[ModelSpec]:
    """Every shape of the family, smallest first: hidden sizes ``hidden_step``, ``2 * hidden_step``...;
    ``settings``: those of :func:`family_shape`."""
    family = _family(family)
    v.positive_int("hidden_step", hidden_step)
    if hidden_step % HIDDEN_PER_LAYER:
        raise ConfigError(f"hidden_step ({hidden_step}) must be a multiple of {HIDDEN_PER_LAYER}")
    hidden = hidden_step
    while True:
        yield family_shape(family, hidden, **settings)
        hidden += hidden_step
