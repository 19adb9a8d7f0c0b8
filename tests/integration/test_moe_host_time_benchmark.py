"""benchmarks/accuracy/moe_host_time.py end to end on the CPU: megatron-core's MoE model (all-to-all
dispatcher) and its dense counterpart built on gloo, traced, timed and counted by phase, and
compared with what the cost model charges at the dense plan's scale."""

import re


def test_moe_and_dense_plans_are_timed_counted_and_compared(python_m):
    done = python_m("benchmarks.accuracy.moe_host_time", "--plans", "moe-host,dense-host", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # the trace counts every phase's kernels; the MoE layer's own ops wait on the device twice per
    # layer on a GPU (the permutation's masked_select), the dense model's never
    kernels = {plan: [float(n) for n in re.findall(r"traced kernels +(\d+)", block)]
               for plan, block in zip(("moe-host", "dense-host"), out.split("dense-host (cpu)"))}
    assert all(n > 0 for n in kernels["moe-host"] + kernels["dense-host"])
    assert kernels["moe-host"][0] > 2 * kernels["dense-host"][0]
    assert "forward masked_select 24" in out and "host would wait on, on a GPU: none" in out
    # the reference plan is charged exactly its own measured time
    assert re.search(r"dense-host: measured / charged x scale: .*step ([\d.]+) / \1 ms \(\+0\.0%\)", out)
    assert re.search(r"moe-host: measured / charged x scale: .*step [\d.]+ / [\d.]+ ms \([+-][\d.]+%\)", out)
