"""Rebuilding the call of one traced aten op from its :class:`~vtrain_plugin.core.graph.KernelKey`.

A key is turned back into a call from the op's schema alone
(``torch.ops.<ns>.<name>.<overload>._schema.arguments``), walking the arguments in order:

- ``Tensor`` consumes the next ``(input_shapes[i], dtypes[i])`` pair, unless ``args`` holds a
  number under its name (``x.mul_(0.9)`` records ``("other", 0.9)``): then the number is passed.
- ``Tensor?`` is None when ``args`` holds ``(name, None)``; otherwise it consumes the next pair.
- ``Tensor[]`` takes its length ``n`` from ``args`` (``(name, n)``) and consumes ``n`` pairs.
- ``Tensor?[]`` takes from ``args`` either a length ``n`` (every item a tensor) or a tuple with one
  entry per item: None for a None item, anything else (e.g. True) for a tensor, which consumes a pair.
- Every other argument is read from ``args`` by name; an absent one takes the schema default.
  ``ScalarType``/``Layout``/``MemoryFormat`` values may be strings ("float16", "torch.float16");
  ``Device`` arguments are replaced by the replay device; ``Generator`` arguments are None.

Inputs are made on the device so that the op runs as in training: the floating operands of matmuls
(``mm``, ``bmm``, ``baddbmm``, ``addmm``, ``linear``, ``matmul``, ``_scaled_mm``) standard normal,
as weights and activations are, because a tensor core's power draw, hence its clock, depends on
the bits it multiplies (on an H100, ``benchmarks/results/h100_kernel_sweep.csv``: a 16384^3 bf16
GEMM runs at 675 TFLOP/s on normal inputs, 744 on U[0, 1) and 829 on zeros); every other floating
tensor uniform in [0, 1) (valid probabilities, non-negative second moments, no overflow in half
precision); bool
tensors whose last two dimensions are equal a causal attention mask (True above the diagonal; a
random mask would cost a CPU kernel several times more in branch mispredictions than the masks
training uses), other bool tensors a random mask, integer tensors random indices in range where
the op says what they index (embedding rows, nll_loss classes, gather/scatter/index_select along
``dim``, ``index`` per dimension) and zeros otherwise (always a valid index). In-place ops reuse
their inputs between repetitions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import KernelKey
from vtrain_plugin.core.op_names import parse_op_name

# Matmuls, whose floating operands are drawn standard normal (see the module docstring).
MATMUL_OPS = frozenset({"mm", "bmm", "baddbmm", "addmm", "linear", "matmul", "_scaled_mm"})

# Namespaces whose ops are communication, not kernels: measured by profiler.comm_bench instead.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``; collectives and unknown ops raise ProfileError."""
    parsed = parse_op_name(name)
    if not parsed.namespace or "." in parsed.overload:
        raise ProfileError(f"kernel {name}: op name must be 'namespace.op.overload'")
    namespace, op_name, overload = parsed.namespace, parsed.name, parsed.overload or "default"
    if namespace in COLLECTIVE_NAMESPACES:
        raise ProfileError(f"kernel {name}: collectives are not replayed as kernels (the collective "
                           f"benchmark measures them)")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        raise ProfileError(f"kernel {name}: no such operator in torch {torch.__version__}") from None


def build_call(key: KernelKey, device: str | torch.device) -> tuple[torch._ops.OpOverload, dict[str, Any]]:
    """The op and the keyword arguments (tensors materialized on ``device``) that replay ``key``."""
    op = resolve_op(key.op)
    dev = torch.device(device)
    normal = parse_op_name(key.op).base in MATMUL_OPS
    given = dict(key.args)
    if len(key.input_shapes) != len(key.dtypes):
        _fail(key, f"has {len(key.input_shapes)} input_shapes but {len(key.dtypes)} dtypes")
    pairs = iter(zip(key.input_shapes, key.dtypes, strict=True))
    tensor_specs: dict[str, Any] = {}  # name -> (shape, dtype) | None | list of those
    scalars: dict[str, Any] = {}
    for arg in op._schema.arguments:
        kind = str(arg.real_type)
        if kind == "Tensor" and arg.name in given:  # a Python number passed for a Tensor (wrapped number)
            scalars[arg.name] = given[arg.name]
        elif kind == "Tensor":
            tensor_specs[arg.name] = _next_pair(key, pairs, arg.name)
        elif kind == "Optional[Tensor]":
            present = not (arg.name in given and given[arg.name] is None)
            tensor_specs[arg.name] = _next_pair(key, pairs, arg.name) if present else None
        elif kind == "List[Tensor]":
            length = _list_length(key, given, arg.name)
            tensor_specs[arg.name] = [_next_pair(key, pairs, arg.name) for _ in range(length)]
        elif kind == "List[Optional[Tensor]]":
            tensor_specs[arg.name] = [_next_pair(key, pairs, arg.name) if present else None
                                      for present in _optional_list(key, given, arg.name)]
        elif arg.name in given:
            scalars[arg.name] = _scalar(key, kind, given[arg.name], dev)
        elif not arg.has_default_value():
            _fail(key, f"lacks argument {arg.name!r} ({kind}), which the schema requires")
    leftover = sum(1 for _ in pairs)
    if leftover:
        _fail(key, f"has {leftover} more tensor inputs than the schema of {key.op} takes")
    highs = _index_bounds(op, tensor_specs, scalars)
    kwargs = dict(scalars)
    for name, spec in tensor_specs.items():
        if isinstance(spec, list):
            kwargs[name] = [None if s is None else _tensor(key, s, dev, highs.get((name, i)), normal)
                            for i, s in enumerate(spec)]
        else:
            kwargs[name] = None if spec is None else _tensor(key, spec, dev, highs.get((name, None)), normal)
    return op, kwargs


def operand_nbytes(kwargs: dict) -> int:
    """Bytes of the tensors among ``kwargs`` (as :func:`build_call` returns them), list items included."""
    total = 0
    for value in kwargs.values():
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# ---- reading the key -------------------------------------------------------------------------------

Pair = tuple[tuple[int, ...], str]


def _fail(key: KernelKey, rule: str) -> NoReturn:
    raise ProfileError(f"kernel {key.op}: key {rule}")


def _next_pair(key: KernelKey, pairs: Iterator[Pair], name: str) -> Pair:
    try:
        return next(pairs)
    except StopIteration:
        _fail(key, f"has too few tensor inputs: none left for argument {name!r}")


def _list_length(key: KernelKey, given: dict[str, Any], name: str) -> int:
    n = given.get(name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        _fail(key, f"argument {name!r} (Tensor[]) must give its length in args, got {n!r}")
    return n


def _optional_list(key: KernelKey, given: dict[str, Any], name: str) -> list[bool]:
    v = given.get(name)
    if isinstance(v, tuple):
        return [item is not None for item in v]
    return [True] * _list_length(key, given, name)


def _scalar(key: KernelKey, kind: str, value: Any, dev: torch.device) -> Any:
    if value is None:
        return None
    if "Device" in kind:
        return dev
    if "Generator" in kind:
        return None
    if any(t in kind for t in ("ScalarType", "Layout", "MemoryFormat")) and isinstance(value, str):
        resolved = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(resolved, (torch.dtype, torch.layout, torch.memory_format)):
            _fail(key, f"value {value!r} is not a torch {kind}")
        return resolved
    return _listed(value)


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


# ---- building inputs -------------------------------------------------------------------------------

def _dtype(key: KernelKey, name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        _fail(key, f"dtype {name!r} is not a torch dtype")
    return dtype


def _tensor(key: KernelKey, pair: Pair, dev: torch.device, high: int | None, normal: bool = False) -> torch.Tensor:
    shape, dtype_name = pair
    dtype = _dtype(key, dtype_name)
    if dtype == torch.bool:
        if len(shape) >= 2 and shape[-1] == shape[-2]:  # an attention mask: causal, True above the diagonal
            return torch.ones(shape[-2:], dtype=torch.bool, device=dev).triu(1).expand(shape).contiguous()
        return torch.rand(shape, device=dev) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        draw = torch.randn if normal else torch.rand
        return draw(shape, device=dev, dtype=torch.float32).to(dtype)
    if high is not None and high > 0:
        return torch.randint(0, high, shape, device=dev, dtype=dtype)
    return torch.zeros(shape, device=dev, dtype=dtype)


def _index_bounds(op: torch._ops.OpOverload, specs: dict[str, Any],
                  scalars: dict[str, Any]) -> dict[tuple[str, int | None], int]:
    """Exclusive upper bounds of the integer tensors that index something: ``(arg, list position) -> high``."""
    rule = _INDEX_RULES.get(parse_op_name(str(op)).base)
    return rule(specs, scalars) if rule else {}


def _size(spec: Any, dim: int) -> int | None:
    if spec is None or isinstance(spec, list):
        return None
    shape = spec[0]
    return shape[dim] if -len(shape) <= dim < len(shape) else None


def _along_dim(index_arg: str) -> Callable[[dict[str, Any], dict[str, Any]], dict]:
    def rule(specs: dict[str, Any], scalars: dict[str, Any]) -> dict:
        dim = scalars.get("dim", 0)
        high = _size(specs.get("self"), dim if isinstance(dim, int) else 0)
        return {(index_arg, None): high} if high else {}
    return rule


def _nll(specs: dict[str, Any], _: dict[str, Any]) -> dict:
    self_spec = specs.get("self")
    high = _size(self_spec, 1 if self_spec and len(self_spec[0]) >= 2 else 0)
    return {("target", None): high} if high else {}


def _per_dim(specs: dict[str, Any], _: dict[str, Any]) -> dict:
    self_spec = specs.get("self")
    return {("indices", i): _size(self_spec, i) for i in range(len(specs.get("indices") or []))
            if self_spec and i < len(self_spec[0])}


_INDEX_RULES: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict]] = {
    "embedding": lambda specs, _: {("indices", None): _size(specs["weight"], 0)},
    "embedding_dense_backward": lambda _, scalars: {("indices", None): scalars.get("num_weights")},
    "embedding_backward": lambda _, scalars: {("indices", None): scalars.get("num_weights")},
    "nll_loss_forward": _nll,
    "nll_loss_backward": _nll,
    "nll_loss2d_forward": _nll,
    "nll_loss2d_backward": _nll,
    "nll_loss": _nll,
    "cross_entropy_loss": _nll,
    "gather": _along_dim("index"),
    "scatter": _along_dim("index"),
    "scatter_add": _along_dim("index"),
    "scatter_reduce": _along_dim("index"),
    "index_select": _along_dim("index"),
    "index_add": _along_dim("index"),
    "index_copy": _along_dim("index"),
    "index_fill": _along_dim("index"),
    "take_along_dim": _along_dim("indices"),
    "index": _per_dim,
    "index_put": _per_dim,
}
