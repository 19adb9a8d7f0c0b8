"""The one table of data types: names as plans spell them, as torch spells them, and their sizes.

Plans and specs use the short names (``fp16``, ``bf16``, ``fp32``, ``fp8``, ``fp4``); graphs and kernel keys
carry torch's names (``float16``, ``bfloat16``, ``float8_e4m3fn``); :func:`canonical_dtype` maps any
of these spellings (with or without ``torch.``) to a :class:`Dtype`, the tensor-core rate class.
"""

from __future__ import annotations

from enum import StrEnum
from functools import lru_cache

from vtrain_plugin.core.errors import ConfigError


class Dtype(StrEnum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    FP8 = "fp8"
    FP4 = "fp4"  # NVFP4's E2M1 (Blackwell), a GEMM input format

    @property
    def nbytes(self) -> int:
        return _NBYTES[self]

    @property
    def torch_name(self) -> str:
        """The torch dtype name (``float16``); FP8 is TransformerEngine's e4m3 format."""
        return _TORCH_NAMES[self]


# Dtypes a model's weights and activations may have (fp8 is a GEMM input format, not a model dtype).
MODEL_DTYPES = (Dtype.FP16, Dtype.BF16, Dtype.FP32)

# FP4: torch's float4_e2m1fn_x2 packs two values in a byte; its element is the pair.
_NBYTES = {Dtype.FP16: 2, Dtype.BF16: 2, Dtype.FP32: 4, Dtype.FP8: 1, Dtype.FP4: 1}
_TORCH_NAMES = {Dtype.FP16: "float16", Dtype.BF16: "bfloat16", Dtype.FP32: "float32", Dtype.FP8: "float8_e4m3fn",
                Dtype.FP4: "float4_e2m1fn_x2"}
_SPELLINGS = {
    "float16": Dtype.FP16, "half": Dtype.FP16, "fp16": Dtype.FP16,
    "bfloat16": Dtype.BF16, "bf16": Dtype.BF16,
    "float32": Dtype.FP32, "float": Dtype.FP32, "fp32": Dtype.FP32,
    "float8_e4m3fn": Dtype.FP8, "float8_e5m2": Dtype.FP8, "float8_e4m3fnuz": Dtype.FP8,
    "float8_e5m2fnuz": Dtype.FP8, "fp8": Dtype.FP8,
    "float4_e2m1fn_x2": Dtype.FP4, "fp4": Dtype.FP4,
}
# Element sizes of the other dtypes tensors in a traced step have (indices, masks).
_OTHER_NBYTES = {"int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                 "float64": 8, "double": 8}


@lru_cache(maxsize=None)
def canonical_dtype(name: str) -> Dtype:
    """The :class:`Dtype` of a floating spelling such as ``"torch.bfloat16"`` or ``"fp16"``."""
    key = str(name).removeprefix("torch.").lower()
    if key not in _SPELLINGS:
        raise ConfigError(f"dtype {name!r} has no tensor-core rate; supported: {', '.join(sorted(_SPELLINGS))}")
    return _SPELLINGS[key]


def element_nbytes(name: str) -> int:
    """Bytes per element of any dtype spelling a traced tensor can have."""
    key = str(name).removeprefix("torch.").lower()
    if key in _OTHER_NBYTES:
        return _OTHER_NBYTES[key]
    return canonical_dtype(key).nbytes
