"""The vTrain seed project's config JSON, translated into plan-file sections.

Keys ``num_gpus, gpu_name, tensor_parallel_size, ...`` describe a GPT-2/3-style model trained in
fp16 by Megatron-DeepSpeed with Adam; see README, "Plan files", for what each key means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs import limits

VTRAIN_BUCKET_SIZE_MB = 40.0  # the seed project's ddp_bucket_size when null (megabytes of gradients)

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
    "ddp_bucket_size": None,  # megabytes of gradients per bucket; null (the seed project's default): 40
    "inter_node_bandwidth": 1600,  # Gbit/s per node (8 x 200 Gb/s InfiniBand)
    "intra_node_bandwidth": 300,  # GB/s per GPU and direction (NVLink 3)
    "pipeline_scheduling": "1f1b",
    "node_size": 8,
    "trace_path": None,  # where the seed project wrote traces; not used
}
_SCHEDULES = ("1f1b", "gpipe")
# Interleaved 1F1B needs virtual pipeline stages, which a vTrain config has no key for.
_INTERLEAVED = ("interleaved", "interleaved_1f1b")
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
    tp, dp, pp = (limits.WORLD_SIZE.positive_int(k, d[k]) for k in
                  ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"))
    num_gpus = limits.WORLD_SIZE.positive_int("num_gpus", d["num_gpus"])
    if num_gpus != tp * pp * dp:
        raise ConfigError(f"num_gpus ({num_gpus}) must equal tensor_parallel_size ({tp}) * "
                          f"pipeline_parallel_size ({pp}) * data_parallel_size ({dp}) = {tp * pp * dp}")
    schedule = d["pipeline_scheduling"]
    if isinstance(schedule, str) and schedule.lower() in _INTERLEAVED:
        raise ConfigError(f"pipeline_scheduling {v.show(schedule)} needs virtual pipeline stages, which a vTrain "
                          f"config cannot give; use a plan file with training.schedule interleaved_1f1b and "
                          f"parallel.virtual_pipeline >= 2")
    if not isinstance(schedule, str) or schedule.lower() not in _SCHEDULES:
        raise ConfigError(f"pipeline_scheduling must be one of {', '.join(_SCHEDULES)}; got {v.show(schedule)}")
    vocab = d["vocab_size"]
    bucket = d["ddp_bucket_size"]
    training_bucket = {"bucket_size_mb": VTRAIN_BUCKET_SIZE_MB if bucket is None
                       else limits.BUCKET_SIZE_MB.positive_number("ddp_bucket_size", bucket)}
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
            "schedule": schedule.lower(),
            "grad_reduce": "overlap" if v.boolean("use_gradient_bucket", d["use_gradient_bucket"])
            else "after_backward",
            **training_bucket,
            "software_stack": "megatron_deepspeed_2023",  # what the vTrain measurements ran
        },
        "cluster": {
            "gpu": v.string("gpu_name", d["gpu_name"]),
            "gpus_per_node": limits.GPUS_PER_NODE.positive_int("node_size", d["node_size"]),
            "intra_node_bandwidth_gbytes_per_s": limits.INTRA_NODE_BANDWIDTH.positive_number(
                "intra_node_bandwidth", d["intra_node_bandwidth"]),
            "inter_node_bandwidth_gbps": limits.INTER_NODE_BANDWIDTH.positive_number(
                "inter_node_bandwidth", d["inter_node_bandwidth"]),
        },
    }
