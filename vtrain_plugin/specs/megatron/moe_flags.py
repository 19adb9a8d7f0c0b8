"""The values of Megatron-LM's MoE flags that are no plain integer: the layer pattern, the
capacity factor, a scaling factor; the flex dispatcher's flags, which several spell.

``--moe-layer-freq`` (and ``--no-rope-freq``, read by :mod:`vtrain_plugin.specs.megatron.attention`)
takes an integer or a Python list expression (``"([0]*3+[1]*58)"``), which Megatron-LM evaluates;
vtrain reads the same expressions without ``eval``: integer lists, their repetition by an integer
and their concatenation, nothing else.
"""

from __future__ import annotations

import ast
from typing import Any

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.flag_values import positive_int


def number(flag: str, text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a number, got {text!r}") from None


def capacity_factor(flag: str, text: Any) -> float | None:
    """A factor, or None where Megatron-LM reads a negative one as no capacity (dropless)."""
    value = number(flag, text)
    return None if value < 0 else value


def layer_freq(flag: str, text: Any) -> int | tuple[int, ...]:
    """An integer k (every k-th layer MoE, or NoPE) or the per-layer list of 0 / 1 a list expression gives."""
    text = str(text).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ConfigError(f"{flag} {text}: must be an integer or a Python list such as ([0]*3+[1]*58)") from None
    value = _evaluate(flag, text, tree)
    return tuple(value) if isinstance(value, list) else value


def _evaluate(flag: str, text: str, node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(flag, text, item) for item in node.elts]
        if all(isinstance(item, int) for item in items):
            return items  # type: ignore[return-value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(flag, text, node.left), _evaluate(flag, text, node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            count = right if isinstance(left, list) else left
            if 0 <= count <= 1_000_000:  # type: ignore[operator]
                return (left if isinstance(left, list) else right) * count  # type: ignore[operator]
        if isinstance(left, int) and isinstance(right, int) and isinstance(node.op, ast.Add):
            return left + right
    raise ConfigError(f"{flag} {text}: must be an integer or a Python list such as ([0]*3+[1]*58) "
                      f"(lists of integers, + and * only)")


def flex_dispatcher_fields(given: dict[str, Any]) -> dict[str, Any]:
    """The flex dispatcher's ParallelPlan fields from its flags: the deprecated ``--moe-enable-deepep``
    (megatron-core: only with ``--moe-token-dispatcher-type flex``, and not with the hybridep
    backend), and the SMs of the active backend (``--moe-flex-dispatcher-num-sms``, else
    ``--moe-deepep-num-sms`` or ``--moe-hybridep-num-sms``; the other backend's flag changes nothing)."""
    out: dict[str, Any] = {}
    backend = given.get("--moe-flex-dispatcher-backend", "deepep")
    if given.get("--moe-enable-deepep"):
        if given.get("--moe-token-dispatcher-type") != "flex":
            raise ConfigError("--moe-enable-deepep requires --moe-token-dispatcher-type flex (megatron-core's rule)")
        if backend != "deepep":
            raise ConfigError(f"--moe-enable-deepep with --moe-flex-dispatcher-backend {backend}: one backend only "
                              f"(megatron-core's rule)")
    backend_sms = {"deepep": "--moe-deepep-num-sms", "hybridep": "--moe-hybridep-num-sms"}.get(backend)
    for flag in ("--moe-flex-dispatcher-num-sms", backend_sms):
        if given.get(flag) is not None:
            out["moe_flex_num_sms"] = positive_int(flag, given[flag])
            break
    return out
