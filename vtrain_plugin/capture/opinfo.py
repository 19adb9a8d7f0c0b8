"""Pure functions from one aten call to what the graph stores about it: kernel key, FLOPs, bytes.

Kept free of any recording state so each piece can be tested on hand-made tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from vtrain_plugin.core import op_names
from vtrain_plugin.core.graph import KernelKey

def op_name(func: Any) -> str:
    """Qualified name like ``aten.mm.default`` (``prim.device`` for prims)."""
    return str(func)


def launches_kernel(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """True when the op runs a device kernel (not a view, metadata, bare allocation or empty copy)."""
    if not op_names.launches_kernel(op_name(func)):
        return False
    return not _is_empty(args)


def _is_empty(args: tuple) -> bool:
    src = args[0] if args else None
    return isinstance(src, torch.Tensor) and src.numel() == 0


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
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            continue  # left at its default
        type_str = str(arg.type)
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(int(d) for d in value.shape))
            dtypes.append(str(value.dtype).replace("torch.", ""))
        elif isinstance(value, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in value):
            present = []
            for x in value:
                if isinstance(x, torch.Tensor):
                    shapes.append(tuple(int(d) for d in x.shape))
                    dtypes.append(str(x.dtype).replace("torch.", ""))
                    present.append(True)
                else:
                    present.append(None)
            extra.append((arg.name, len(value) if all(present) else tuple(present)))
        elif value is None and "Tensor" in type_str:
            extra.append((arg.name, None))
        elif "ProcessGroup" in type_str or "ScriptObject" in type(value).__name__:
            continue
        else:
            extra.append((arg.name, _scalar(value)))
    return KernelKey(op=op_name(func), input_shapes=tuple(shapes), dtypes=tuple(dtypes), args=tuple(extra))


def flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Matrix-multiply FLOPs (2 per multiply-add) by torch's flop counter; 0 for other ops.

    Only matmul-class FLOPs are counted, as in Megatron-LM's model-FLOPs formula.
    """
    formula = flop_registry.get(getattr(func, "_overloadpacket", None))
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
        return (tuple(int(d) for d in out.shape),)
    if isinstance(out, (list, tuple)):
        return tuple(s for o in out for s in output_shapes(o))
    return ()
