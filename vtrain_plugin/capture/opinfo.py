"""Pure functions from one aten call to what the graph stores about it: kernel key, FLOPs, bytes.

Kept free of any recording state so each piece can be tested on hand-made tensors. What depends on
the op alone (its name, whether it launches a kernel, its schema's arguments, its FLOP formula) is
worked out once per op overload and kept (:func:`op_info`): a trace calls each op thousands of times.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from vtrain_plugin.core import op_names
from vtrain_plugin.core.graph import KernelKey


class OpInfo:
    """What the recorder needs of an op overload that does not depend on its arguments."""

    __slots__ = ("func", "name", "prim", "launches", "arguments", "flop_formula")

    def __init__(self, func: Any) -> None:
        self.func = func  # held: the table is keyed by its id
        self.name = str(func)
        self.prim = func.namespace == "prim"  # a fake tensor's metadata query (prim.device)
        self.launches = op_names.launches_kernel(self.name)
        # (name, whether its type mentions Tensor, whether it is a ProcessGroup), in schema order
        self.arguments = tuple((arg.name, "Tensor" in (t := str(arg.type)), "ProcessGroup" in t)
                               for arg in func._schema.arguments)
        self.flop_formula = flop_registry.get(getattr(func, "_overloadpacket", None))


# by the op overload's id: an int hashes in C, an OpOverload in Python, on every op of a trace
_INFO: dict[int, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """``func``'s :class:`OpInfo`, worked out on its first call."""
    info = _INFO.get(id(func))
    if info is None:
        info = _INFO[id(func)] = OpInfo(func)
    return info


def op_name(func: Any) -> str:
    """Qualified name like ``aten.mm.default`` (``prim.device`` for prims)."""
    return op_info(func).name


def launches_kernel(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """True when the op runs a device kernel (not a view, metadata, bare allocation or empty copy)."""
    if not op_info(func).launches:
        return False
    return not _is_empty(args)


def _is_empty(args: tuple) -> bool:
    src = args[0] if args else None
    return isinstance(src, torch.Tensor) and src.numel() == 0


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``float16`` for ``torch.float16``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _scalar(value: Any) -> Any:
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        return tuple(_scalar(v) for v in value)
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def kernel_key(func: Any, args: tuple, kwargs: dict) -> KernelKey:
    """Build the kernel key of a call, walking the op's schema so replay can rebuild the call.

    Encoding: tensor arguments contribute their shape and dtype, in schema order; a ``Tensor[]`` or
    ``Tensor?[]`` argument contributes its tensors and an ``args`` entry with its length (or, when
    some items are None, a tuple with ``None`` for those and ``True`` for tensors); a ``Tensor?``
    argument that is None appears in ``args`` as ``(name, None)`` and contributes no shape; every
    other argument appears in ``args`` by name with its JSON value.
    """
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    extra: list[tuple[str, Any]] = []
    for i, (name, tensor_type, process_group) in enumerate(op_info(func).arguments):
        if i < len(args):
            value = args[i]
        elif name in kwargs:
            value = kwargs[name]
        else:
            continue  # left at its default
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(map(int, value.shape)))
            dtypes.append(dtype_name(value.dtype))
        elif isinstance(value, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in value):
            present = []
            for x in value:
                if isinstance(x, torch.Tensor):
                    shapes.append(tuple(map(int, x.shape)))
                    dtypes.append(dtype_name(x.dtype))
                    present.append(True)
                else:
                    present.append(None)
            extra.append((name, len(value) if all(present) else tuple(present)))
        elif value is None and tensor_type:
            extra.append((name, None))
        elif process_group or "ScriptObject" in type(value).__name__:
            continue
        else:
            extra.append((name, _scalar(value)))
    return KernelKey(op=op_info(func).name, input_shapes=tuple(shapes), dtypes=tuple(dtypes), args=tuple(extra))


def flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Matrix-multiply FLOPs (2 per multiply-add) by torch's flop counter; 0 for other ops.

    Only matmul-class FLOPs are counted, as in Megatron-LM's model-FLOPs formula.
    """
    formula = op_info(func).flop_formula
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def tensor_nbytes(value: Any) -> int:
    total = 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        for v in value:
            total += tensor_nbytes(v)
    return total


def moved_nbytes(args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes a kernel reads (tensor inputs) plus writes (tensor outputs)."""
    return tensor_nbytes(args) + tensor_nbytes(tuple(kwargs.values())) + tensor_nbytes(out)


def output_shapes(out: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(out, torch.Tensor):
        return (tuple(map(int, out.shape)),)
    if isinstance(out, (list, tuple)):
        return tuple(s for o in out for s in output_shapes(o))
    return ()
