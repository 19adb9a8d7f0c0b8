"""Layer features beyond vtrain's two layer families, with one answer on every input path.

A Megatron-LM command line (:mod:`vtrain_plugin.specs.megatron.model`), a megatron-core
``TransformerConfig`` (:mod:`megatron_adapters.config_map`) and a plan file's model section
(:mod:`vtrain_plugin.specs.plan_file`) can each ask for them, and each gets the same answer:

- refused (:data:`REFUSED`, :func:`not_modelled`): features that change the GEMMs, the attention
  or the activations vtrain traces, one line ``NAME: WHAT is not modelled by vtrain yet``;
- noted (:func:`layer_note`): a normalization, linear biases or dropout other than the family's
  (gpt: LayerNorm, biases, dropout 0.1; llama: RMSNorm, no biases, no dropout). They change
  memory-bound kernels and a few parameters per layer, not the GEMMs: the MLP picks the family
  (SwiGLU: llama), and the difference is one warning line. A plan file names the family only, so
  it has nothing to note.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.model import Family


@dataclass(frozen=True, slots=True)
class Feature:
    """A feature vtrain refuses, by its name on each input path."""

    what: str
    flag: str  # Megatron-LM's flag
    config_field: str  # megatron-core TransformerConfig's field (off: None, False or 0)
    plan_key: str  # a plan file's model key


REFUSED = (
    Feature("query/key layer norm", "--qk-layernorm", "qk_layernorm", "qk_layernorm"),
    Feature("query/key L2 norm", "--qk-l2-norm", "qk_l2_norm", "qk_l2_norm"),
    Feature("a residual stream in fp32", "--fp32-residual-connection", "fp32_residual_connection",
            "fp32_residual_connection"),
)
QKV_BIAS = "a QKV bias without the other linear biases"

LAYERS = {
    Family.GPT: {"normalization": "LayerNorm", "biases": "on", "dropout": 0.1},
    Family.LLAMA: {"normalization": "RMSNorm", "biases": "off", "dropout": 0.0},
}


def not_modelled(name: str, what: str) -> ConfigError:
    """The refusal of a feature vtrain does not model, ``name`` as the input path spells it."""
    return ConfigError(f"{name}: {what} is not modelled by vtrain yet")


def unmodelled_warning(inputs: str, notes: list[str] | tuple[str, ...]) -> str:
    """The one warning line of an input's notes (``inputs``: what they are, e.g. "Megatron-LM arguments")."""
    return f"{inputs} vtrain does not model (they may change speed or memory): " + ", ".join(notes)


def layer_note(name: str, family: Family, key: str, value: object) -> str | None:
    """The warning note for a layer whose ``key`` (normalization, biases, dropout) is ``value``
    where the ``family``'s layer has another; None when they agree."""
    expected = LAYERS[family][key]
    if value == expected:
        return None
    return f"{name} (vtrain's {family.value} layers: {expected})"
