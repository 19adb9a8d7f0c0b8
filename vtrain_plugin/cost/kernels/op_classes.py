"""Which kind of kernel an aten op runs, from its qualified name (``aten.mm.default``).

The class decides how the analytical model times an op (tensor-core roofline for GEMM and fused
attention, memory roofline for the rest, nothing for views) and groups ops in breakdowns. The name is
normalized first: the namespace and overload are dropped, one trailing ``_`` of an in-place op is
removed (``bernoulli_`` -> ``bernoulli``) and a ``_backward``/``_backward_data`` suffix maps a
backward op to its forward's class (``native_layer_norm_backward`` -> NORM). Ops in no table run
ordinary memory-bound kernels (ELEMENTWISE), which is what most of aten's long tail is.
"""

from __future__ import annotations

from enum import StrEnum

from vtrain_plugin.core.graph import Phase
from vtrain_plugin.core.op_names import HOST_SYNC_OPS, NO_KERNEL_OPS, parse_op_name


class OpClass(StrEnum):
    GEMM = "gemm"  # tensor-core matrix multiplies (and convolutions)
    ATTENTION = "attention"  # fused attention kernels (SDPA flash / memory-efficient / cuDNN, TE's)
    NORM = "norm"
    SOFTMAX = "softmax"
    ACTIVATION = "activation"
    DROPOUT = "dropout"  # dropout and random-number generation
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    EMBEDDING = "embedding"
    LOSS = "loss"
    OPTIMIZER = "optimizer"  # multi-tensor / fused optimizer kernels, and every kernel of the optimizer phase
    COPY = "copy"
    HOST_SYNC = "host_sync"  # reads a device value on the host: no kernel, but the CPU waits for the GPU
    NO_KERNEL = "no_kernel"  # views, metadata, bare allocation


_TABLE: dict[OpClass, frozenset[str]] = {
    OpClass.GEMM: frozenset({
        "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "grouped_gemm",
        "convolution", "_convolution", "cudnn_convolution",
        # mamba_ssm's SSD kernels multiply on tensor cores (vtrain_plugin/cost/lowering/mamba.py)
        "mamba_chunk_state_fwd", "mamba_bmm_chunk_fwd", "mamba_chunk_scan_fwd", "mamba_chunk_scan_bwd_dstates",
        "mamba_chunk_scan_chunk_state_bwd_dx", "mamba_chunk_scan_bwd_dC", "mamba_chunk_state_bwd_db",
        "mamba_chunk_scan_bwd_dcb", "mamba_bmm_chunk_bwd", "mamba_chunk_scan_bwd_ddAcs",
    }),
    OpClass.ATTENTION: frozenset({
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_flash_attention",
        "_efficient_attention_forward", "_efficient_attention", "fused_attention",
    }),
    OpClass.NORM: frozenset({
        "native_layer_norm", "layer_norm", "fused_layer_norm_affine", "rms_norm", "_fused_rms_norm",
        "native_group_norm", "mamba_gated_rms_norm_fwd", "mamba_gated_rms_norm_bwd",
        "group_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training", "cudnn_batch_norm",
    }),
    OpClass.SOFTMAX: frozenset({"_softmax", "softmax", "_masked_softmax", "_safe_softmax",
                                "scaled_upper_triang_masked_softmax", "scaled_masked_softmax"}),
    OpClass.ACTIVATION: frozenset({
        "gelu", "relu", "silu", "sigmoid", "tanh", "threshold", "hardtanh", "leaky_relu", "elu",
        "softplus", "mish", "glu", "hardswish", "hardsigmoid", "bias_gelu_fused", "swiglu_fused",
        "quick_geglu_fused",
    }),
    OpClass.DROPOUT: frozenset({
        "native_dropout", "dropout", "bernoulli", "rand", "rand_like", "randn", "randn_like",
        "randint", "randint_like", "uniform", "normal", "random", "bias_dropout_add_fused_train",
    }),
    OpClass.REDUCTION: frozenset({
        "sum", "mean", "norm", "linalg_vector_norm", "amax", "amin", "max", "min", "argmax", "argmin",
        "prod", "var", "std", "var_mean", "std_mean", "logsumexp", "cumsum", "any", "all", "compute_amax",
    }),
    OpClass.EMBEDDING: frozenset({"embedding", "embedding_dense", "_embedding_bag", "embedding_renorm"}),
    OpClass.LOSS: frozenset({
        "_log_softmax", "log_softmax", "nll_loss", "nll_loss_forward", "nll_loss2d",
        "nll_loss2d_forward", "cross_entropy_loss", "mse_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "vocab_parallel_ce_logits_max", "vocab_parallel_ce_predicted_logits",
        "vocab_parallel_ce_loss", "vocab_parallel_ce_gradients",
    }),
    OpClass.OPTIMIZER: frozenset({"_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad"}),
    OpClass.COPY: frozenset({
        "copy", "_to_copy", "clone", "cat", "stack", "_copy_from", "_copy_from_and_resize", "repeat",
        "constant_pad_nd", "lift_fresh_copy", "cast_transpose", "fp8_transpose",
        "quantize_mxfp8", "quantize_fp8_block", "quantize_nvfp4",
    }),
    OpClass.HOST_SYNC: HOST_SYNC_OPS,
    OpClass.NO_KERNEL: NO_KERNEL_OPS,
}

_BY_NAME: dict[str, OpClass] = {name: cls for cls, names in _TABLE.items() for name in names}

_NO_LAUNCH = frozenset({OpClass.NO_KERNEL, OpClass.HOST_SYNC})


def classify(op_name: str, phase: Phase | None = None) -> OpClass:
    """The class of an op; every kernel an optimizer-phase op launches counts as OPTIMIZER.

    The backward of a view (``select_backward``, ``slice_backward``) materializes a gradient
    tensor, so it is a COPY although its forward launches nothing.
    """
    parsed = parse_op_name(op_name)
    if parsed.namespace == "prim":  # prim.device, prim.layout: metadata
        return OpClass.NO_KERNEL
    name, backward = parsed.forward
    multi_tensor = name.startswith(("_foreach_", "multi_tensor_"))
    cls = OpClass.OPTIMIZER if multi_tensor else _BY_NAME.get(name, OpClass.ELEMENTWISE)
    if backward and cls in _NO_LAUNCH:
        cls = OpClass.COPY
    if phase is Phase.OPTIMIZER and cls not in _NO_LAUNCH:
        return OpClass.OPTIMIZER
    return cls
