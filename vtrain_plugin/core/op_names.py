"""Qualified op names (``aten.native_layer_norm_backward.default``), parsed once into a value.

Every consumer (op classes, the software-stack lowering, the GEMM dims of the kernel model, replay)
reads the parts it needs from :class:`OpName` instead of splitting strings itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class OpName:
    namespace: str  # "aten", "prim", "c10d", "apex", "megatron", ...
    name: str  # "native_layer_norm_backward", "bernoulli_"
    overload: str  # "default", "Tensor", ... ("" when the name has none)

    @property
    def base(self) -> str:
        """The name without the trailing ``_`` of an in-place op (``bernoulli_`` -> ``bernoulli``)."""
        if self.name.endswith("_") and not self.name.endswith("__"):
            return self.name[:-1]
        return self.name

    @property
    def forward(self) -> tuple[str, bool]:
        """``(forward op's base name, True)`` for a backward op, ``(base, False)`` otherwise.

        ``native_layer_norm_backward`` -> ``("native_layer_norm", True)``;
        ``_softmax_backward_data`` -> ``("_softmax", True)``.
        """
        base = self.base
        for suffix in ("_backward_data", "_backward"):
            if base.endswith(suffix) and base != suffix:
                return base.removesuffix(suffix), True
        return base, False

    def __str__(self) -> str:
        return ".".join(p for p in (self.namespace, self.name, self.overload) if p)


@lru_cache(maxsize=4096)
def parse_op_name(qualified: str) -> OpName:
    """``"aten.mm.default"`` -> ``OpName("aten", "mm", "default")``; a bare ``"mm"`` has no namespace."""
    parts = qualified.split(".")
    if len(parts) == 1:
        return OpName("", parts[0], "")
    if len(parts) == 2:
        return OpName(parts[0], parts[1], "")
    return OpName(parts[0], parts[1], ".".join(parts[2:]))


# Ops that launch no device kernel: views, metadata, bare allocation; and host reads of a device
# value (no kernel, but the CPU waits for the GPU). Capture marks them, cost gives them no time.
NO_KERNEL_OPS: frozenset[str] = frozenset({
        "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "flatten", "unflatten", "t",
        "transpose", "permute", "movedim", "expand", "expand_as", "as_strided", "detach", "alias",
        "lift_fresh", "slice", "select", "split", "split_with_sizes", "unsafe_split", "unbind", "chunk",
        "narrow", "unsqueeze", "squeeze", "diagonal", "unfold", "empty", "empty_like",
        "empty_strided", "new_empty", "new_empty_strided", "set", "resize", "is_same_size",
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "numel",
        "is_contiguous", "requires_grad", "retain_grad", "device", "record_stream",
    })
HOST_SYNC_OPS: frozenset[str] = frozenset({"_local_scalar_dense", "item", "is_nonzero"})


def launches_kernel(op_name: str) -> bool:
    """False for views, metadata, bare allocation and host reads of device scalars (by base name).

    The backward of a view (``select_backward``) materializes a gradient, so it launches a kernel.
    """
    parsed = parse_op_name(op_name)
    if parsed.namespace == "prim":  # prim.device, prim.layout: metadata
        return False
    name, backward = parsed.forward
    return backward or name not in NO_KERNEL_OPS | HOST_SYNC_OPS
