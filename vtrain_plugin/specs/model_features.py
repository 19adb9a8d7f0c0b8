"""Layer features vtrain refuses, with one answer on every input path.

A Megatron-LM command line (:mod:`vtrain_plugin.specs.megatron.model`), a megatron-core
``TransformerConfig`` (:mod:`megatron_adapters.config_map`) and a plan file's model section
(:mod:`vtrain_plugin.specs.plan_file`) can each ask for them, and each gets the same one line,
``NAME: WHAT is not modelled by vtrain yet`` (:data:`REFUSED`, :func:`not_modelled`). The layer
choices vtrain models (normalization, activation, biases, dropout, positions, head dim, QK norms)
are ModelSpec fields (:mod:`vtrain_plugin.specs.model`), read alike on every path.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtrain_plugin.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Feature:
    """A feature vtrain refuses, by its name on each input path."""

    what: str
    flag: str  # Megatron-LM's flag
    config_field: str  # megatron-core TransformerConfig's field (off: None, False or 0)
    plan_key: str  # a plan file's model key


REFUSED = (
    Feature("a residual stream in fp32", "--fp32-residual-connection", "fp32_residual_connection",
            "fp32_residual_connection"),
)

# Position embeddings megatron-core builds that vtrain does not trace yet (GPTModel's names)
POSITIONS_NOT_MODELLED = {"yarn": "YaRN rotary embeddings", "mrope": "multimodal rotary embeddings",
                          "relative": "relative position embeddings"}


def not_modelled(name: str, what: str) -> ConfigError:
    """The refusal of a feature vtrain does not model, ``name`` as the input path spells it."""
    return ConfigError(f"{name}: {what} is not modelled by vtrain yet")


def unmodelled_warning(inputs: str, notes: list[str] | tuple[str, ...]) -> str:
    """The one warning line of an input's notes (``inputs``: what they are, e.g. "Megatron-LM arguments")."""
    return f"{inputs} vtrain does not model (they may change speed or memory): " + ", ".join(notes)
