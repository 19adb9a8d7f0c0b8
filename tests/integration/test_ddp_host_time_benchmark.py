"""benchmarks/accuracy/ddp_host_time.py end to end on the CPU: megatron-core's GPT wrapped in its own
DDP with the distributed optimizer on gloo, every module call's pre-hook counted, both passes and the
optimizers' per-parameter copy loops timed; a bad repeat count exits 2 naming the flag."""

import re


def test_the_hooks_are_counted_and_timed(python_m):
    done = python_m("benchmarks.accuracy.ddp_host_time", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    # the model's 213 modules less one its forward never calls; 12 parameters a layer, the two
    # embeddings and the final norm's two (the output layer's weight is the word embedding)
    assert re.search(r"forward: 212 module calls, [\d.]+ ms with the pre-hooks, [\d.]+ ms without: "
                     r"-?[\d.]+ us per hook call", done.stdout), done.stdout
    assert re.search(r"backward \(no_sync\): 148 parameters", done.stdout), done.stdout
    for part in ("grads", "weights"):  # both optimizers' loops, timed per parameter
        assert re.search(rf"optimizer step, {part} copied: [\d.]+ us per parameter \(DistributedOptimizer\), "
                         r"[\d.]+ us \(Float16OptimizerWithFloat16Params, bf16\)", done.stdout), done.stdout


def test_a_bad_repeat_count_exits_2(python_m):
    done = python_m("benchmarks.accuracy.ddp_host_time", "--repeats", "0")
    assert done.returncode == 2
    assert "--repeats: 0 must be at least 1" in done.stderr
