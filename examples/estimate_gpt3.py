"""Trace GPT-3 175B on its 512-GPU layout, estimate one iteration on DGX A100 nodes, print it.

Run: .venv/bin/python examples/estimate_gpt3.py
"""

import vtrain_plugin as vtrain

model = vtrain.ModelSpec(name="gpt3-175b", num_layers=96, hidden_size=12288, num_attention_heads=96,
                         seq_length=2048, vocab_size=51200, dtype="fp16")
plan = vtrain.ParallelPlan(tensor_parallel=8, pipeline_parallel=16, data_parallel=4, micro_batch_size=1,
                           recompute="full")

graph = vtrain.trace(model, plan)
print(f"traced {len(graph.stages)} pipeline stages, {len(graph.unique_kernels())} unique kernels")

est = vtrain.estimate(graph, cluster=vtrain.get_cluster_preset("dgx-a100"),
                      training=vtrain.TrainingSpec(global_batch_size=1536))
print(f"iteration: {est.iteration_time_ms / 1000:.2f} s on {est.num_gpus} GPUs, "
      f"{est.tflops_per_gpu:.0f} TFLOP/s per GPU (MFU {est.mfu:.0%}), ${est.cost_usd:.2f} per iteration")
for name, ms in est.breakdown_ms.items():
    print(f"  {name:15s} {ms:10.1f} ms")
