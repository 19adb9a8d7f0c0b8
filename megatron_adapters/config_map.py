"""Map other tools' descriptions of a run onto vtrain's specs.

- The vTrain seed project's config JSON (keys ``num_gpus, gpu_name, tensor_parallel_size, ...``),
  which describes a GPT-2/3-style model trained in fp16 by Megatron-DeepSpeed.
- A megatron-core ``TransformerConfig`` (read by attribute, so no megatron type leaks out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vtrain_plugin import _validate as v
from vtrain_plugin.errors import ConfigError
from vtrain_plugin.plan import Dtype, Family, ModelSpec, ParallelPlan, Recompute

VTRAIN_REQUIRED = (
    "num_gpus", "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size",
    "global_batch_size", "micro_batch_size", "num_layers", "hidden_size", "num_attention_heads",
    "max_length",
)
VTRAIN_OPTIONAL = {
    "gpu_name": "A100",
    "vocab_size": None,  # null means GPT-2's 50257
    "use_checkpoint": True,
    "use_gradient_bucket": False,
    "ddp_bucket_size": 40,  # megabytes of gradients per bucket
    "inter_node_bandwidth": 1600,  # Gbit/s per node (8 x 200 Gb/s InfiniBand)
    "intra_node_bandwidth": 300,  # GB/s per GPU and direction (NVLink 3)
    "pipeline_scheduling": "1f1b",
    "node_size": 8,
    "trace_path": None,  # where the seed project wrote traces; not used
}
_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved_1f1b",
              "interleaved_1f1b": "interleaved_1f1b"}
GPT2_VOCAB = 50257


def is_vtrain_config(data: Mapping[str, Any]) -> bool:
    return "tensor_parallel_size" in data and "num_gpus" in data


def from_vtrain_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a vTrain config into vtrain plan-file sections (model, parallel, training, cluster)."""
    v.no_unknown_keys("vTrain config", data, [*VTRAIN_REQUIRED, *VTRAIN_OPTIONAL])
    missing = [k for k in VTRAIN_REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"vTrain config: missing key {missing[0]!r}")
    d = {**VTRAIN_OPTIONAL, **data}
    tp, dp, pp = (v.positive_int(k, d[k]) for k in
                  ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"))
    num_gpus = v.positive_int("num_gpus", d["num_gpus"])
    if num_gpus != tp * pp * dp:
        raise ConfigError(f"num_gpus ({num_gpus}) must equal tensor_parallel_size ({tp}) * "
                          f"pipeline_parallel_size ({pp}) * data_parallel_size ({dp}) = {tp * pp * dp}")
    schedule = d["pipeline_scheduling"]
    if not isinstance(schedule, str) or schedule.lower() not in _SCHEDULES:
        raise ConfigError(f"pipeline_scheduling must be one of {', '.join(_SCHEDULES)}; got {schedule!r}")
    vocab = d["vocab_size"]
    gpu_name = d["gpu_name"]
    if not isinstance(gpu_name, str):
        raise ConfigError(f"gpu_name must be a string, got {gpu_name!r}")
    return {
        "model": {
            "family": "gpt",
            "num_layers": d["num_layers"],
            "hidden_size": d["hidden_size"],
            "num_attention_heads": d["num_attention_heads"],
            "seq_length": d["max_length"],
            "vocab_size": GPT2_VOCAB if vocab is None else vocab,
            "dtype": "fp16",
        },
        "parallel": {
            "tensor_parallel": tp,
            "pipeline_parallel": pp,
            "data_parallel": dp,
            "micro_batch_size": d["micro_batch_size"],
            "recompute": "full" if v.boolean("use_checkpoint", d["use_checkpoint"]) else "none",
        },
        "training": {
            "global_batch_size": d["global_batch_size"],
            "schedule": _SCHEDULES[schedule.lower()],
            "grad_reduce": "overlap" if v.boolean("use_gradient_bucket", d["use_gradient_bucket"])
            else "after_backward",
            "bucket_size_mb": v.positive_number("ddp_bucket_size", d["ddp_bucket_size"]),
            "software_stack": "megatron_deepspeed_2023",  # what the vTrain measurements ran
        },
        "cluster": {
            "gpu": gpu_name,
            "gpus_per_node": v.positive_int("node_size", d["node_size"]),
            "intra_node_bandwidth_gbytes_per_s": v.positive_number("intra_node_bandwidth", d["intra_node_bandwidth"]),
            "inter_node_bandwidth_gbps": v.positive_number("inter_node_bandwidth", d["inter_node_bandwidth"]),
        },
    }


def model_spec_from_transformer_config(config: Any, *, vocab_size: int, seq_length: int) -> ModelSpec:
    """A ModelSpec for a megatron-core TransformerConfig built with the local layer spec."""
    llama = getattr(config, "normalization", "LayerNorm") == "RMSNorm" or getattr(config, "gated_linear_unit", False)
    dtype = Dtype.BF16 if getattr(config, "bf16", False) else Dtype.FP16 if getattr(config, "fp16", False) else Dtype.FP32
    return ModelSpec(
        family=Family.LLAMA if llama else Family.GPT,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        seq_length=seq_length,
        vocab_size=vocab_size,
        dtype=dtype,
    )


def parallel_plan_from_transformer_config(config: Any, *, data_parallel: int = 1, micro_batch_size: int = 1) -> ParallelPlan:
    granularity = getattr(config, "recompute_granularity", None)
    return ParallelPlan(
        tensor_parallel=config.tensor_model_parallel_size,
        pipeline_parallel=config.pipeline_model_parallel_size,
        data_parallel=data_parallel,
        sequence_parallel=bool(config.sequence_parallel),
        virtual_pipeline=config.virtual_pipeline_model_parallel_size or 1,
        micro_batch_size=micro_batch_size,
        recompute=Recompute(granularity) if granularity else Recompute.NONE,
    )
