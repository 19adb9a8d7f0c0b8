import io

import pytest
import torch

from profiler.db import ProfileDB
from profiler.device_timing import TimingPolicy
from profiler.fingerprint import DeviceFingerprint, DeviceKind, current_fingerprint
from profiler.kernel_call import build_call
from profiler.progress import ProgressBar
from profiler.replay import profile_kernels, replay_kernel
from vtrain_plugin.core.errors import ProfileError
from vtrain_plugin.core.graph import KernelKey

F32 = "float32"
FAST = TimingPolicy(warmup=1, min_repetitions=5, max_repetitions=10, budget_s=0.01)

KEYS = {
    "mm": KernelKey(op="aten.mm.default", input_shapes=((64, 32), (32, 16)), dtypes=(F32, F32)),
    "baddbmm": KernelKey(op="aten.baddbmm.default", input_shapes=((4, 8, 8), (4, 8, 16), (4, 16, 8)),
                         dtypes=(F32,) * 3, args=(("beta", 0.0), ("alpha", 0.125))),
    "layer_norm": KernelKey(op="aten.native_layer_norm.default", input_shapes=((4, 8, 16), (16,), (16,)),
                            dtypes=(F32,) * 3, args=(("normalized_shape", (16,)), ("eps", 1e-5))),
    "layer_norm_no_affine": KernelKey(op="aten.native_layer_norm.default", input_shapes=((4, 8, 16),),
                                      dtypes=(F32,), args=(("normalized_shape", (16,)), ("weight", None),
                                                           ("bias", None), ("eps", 1e-5))),
    "embedding": KernelKey(op="aten.embedding.default", input_shapes=((100, 16), (4, 8)), dtypes=(F32, "int64")),
    "embedding_backward": KernelKey(op="aten.embedding_dense_backward.default",
                                    input_shapes=((4, 8, 16), (4, 8)), dtypes=(F32, "int64"),
                                    args=(("num_weights", 100), ("padding_idx", -1),
                                          ("scale_grad_by_freq", False))),
    "softmax": KernelKey(op="aten._softmax.default", input_shapes=((4, 8, 8),), dtypes=(F32,),
                         args=(("dim", -1), ("half_to_float", False))),
    "dropout": KernelKey(op="aten.native_dropout.default", input_shapes=((4, 8, 16),), dtypes=(F32,),
                         args=(("p", 0.1), ("train", True))),
    "bernoulli_": KernelKey(op="aten.bernoulli_.float", input_shapes=((4, 8),), dtypes=(F32,), args=(("p", 0.5),)),
    "nll_loss": KernelKey(op="aten.nll_loss_forward.default", input_shapes=((8, 100), (8,)), dtypes=(F32, "int64"),
                          args=(("weight", None), ("reduction", 1), ("ignore_index", -100))),
    "addcmul_": KernelKey(op="aten.addcmul_.default", input_shapes=((16, 16),) * 3, dtypes=(F32,) * 3,
                          args=(("value", 0.5),)),
    "lerp_": KernelKey(op="aten.lerp_.Scalar", input_shapes=((16,), (16,)), dtypes=(F32, F32), args=(("weight", 0.1),)),
    "foreach_add_": KernelKey(op="aten._foreach_add_.List", input_shapes=((16,), (8,), (16,), (8,)),
                              dtypes=(F32,) * 4, args=(("self", 2), ("other", 2), ("alpha", 1.0))),
    "fused_adam_": KernelKey(
        op="aten._fused_adam_.default", input_shapes=((16,), (8,)) * 4 + ((), ()), dtypes=(F32,) * 10,
        args=(("self", 2), ("grads", 2), ("exp_avgs", 2), ("exp_avg_sqs", 2), ("max_exp_avg_sqs", 0),
              ("state_steps", 2), ("lr", 1e-3), ("beta1", 0.9), ("beta2", 0.95), ("weight_decay", 0.1),
              ("eps", 1e-8), ("amsgrad", False), ("maximize", False), ("grad_scale", None), ("found_inf", None))),
    "masked_fill": KernelKey(op="aten.masked_fill.Scalar", input_shapes=((4, 8), (4, 8)), dtypes=(F32, "bool"),
                             args=(("value", -1e4),)),
    "index": KernelKey(op="aten.index.Tensor", input_shapes=((10, 20), (5,)), dtypes=(F32, "int64"),
                       args=(("indices", (None, True)),)),
    "to_copy": KernelKey(op="aten._to_copy.default", input_shapes=((4, 8),), dtypes=(F32,),
                         args=(("dtype", "torch.bfloat16"), ("device", "meta"), ("layout", "torch.strided"))),
}


@pytest.mark.parametrize("name", sorted(KEYS))
def test_replay_on_cpu_gives_positive_median(name):
    result = replay_kernel(KEYS[name], "cpu", policy=FAST)
    assert result.median_ns > 0
    assert 5 <= result.repetitions <= 10
    assert result.iqr_ns >= 0


def test_indices_are_in_range_of_what_they_index():
    key = KernelKey(op="aten.embedding.default", input_shapes=((3, 4), (1000,)), dtypes=(F32, "int64"))
    _, kwargs = build_call(key, "cpu")
    assert kwargs["indices"].min() >= 0 and kwargs["indices"].max() == 2
    key = KernelKey(op="aten.embedding_dense_backward.default", input_shapes=((1000, 4), (1000,)),
                    dtypes=(F32, "int64"),
                    args=(("num_weights", 7), ("padding_idx", -1), ("scale_grad_by_freq", False)))
    _, kwargs = build_call(key, "cpu")
    assert kwargs["indices"].max() == 6
    _, kwargs = build_call(KEYS["nll_loss"], "cpu")
    assert kwargs["target"].max() < 100
    _, kwargs = build_call(KEYS["index"], "cpu")
    assert kwargs["indices"][0] is None and kwargs["indices"][1].max() < 20
    _, kwargs = build_call(KEYS["masked_fill"], "cpu")
    assert kwargs["mask"].dtype == torch.bool


def test_optional_tensor_none_and_tensor_lists_follow_the_encoding():
    _, kwargs = build_call(KEYS["layer_norm_no_affine"], "cpu")
    assert kwargs["weight"] is None and kwargs["bias"] is None and kwargs["input"].shape == (4, 8, 16)
    _, kwargs = build_call(KEYS["fused_adam_"], "cpu")
    assert [t.shape for t in kwargs["exp_avgs"]] == [(16,), (8,)]
    assert kwargs["max_exp_avg_sqs"] == [] and kwargs["grad_scale"] is None
    _, kwargs = build_call(KEYS["to_copy"], "cpu")
    assert kwargs["dtype"] is torch.bfloat16 and kwargs["device"] == torch.device("cpu")


@pytest.mark.parametrize(("key", "match"), [
    (KernelKey(op="c10d.allreduce_.default", input_shapes=((4,),), dtypes=(F32,)), "c10d.allreduce_.default"),
    (KernelKey(op="_c10d_functional.all_reduce.default", input_shapes=((4,),), dtypes=(F32,)), "collectives"),
    (KernelKey(op="aten.no_such_op.default", input_shapes=(), dtypes=()), "no such operator"),
    (KernelKey(op="aten.mm.default", input_shapes=((4, 4),), dtypes=(F32,)), "too few tensor inputs.*'mat2'"),
    (KernelKey(op="aten.mm.default", input_shapes=((4, 4),) * 3, dtypes=(F32,) * 3), "1 more tensor inputs"),
    (KernelKey(op="aten.mm.default", input_shapes=((4, 4), (5, 5)), dtypes=(F32, F32)), "replay on cpu failed"),
    (KernelKey(op="aten._softmax.default", input_shapes=((4,),), dtypes=(F32,)), "lacks argument 'dim'"),
    (KernelKey(op="aten.cat.default", input_shapes=((4,),), dtypes=(F32,)), "'tensors' .*length"),
    (KernelKey(op="aten.mm.default", input_shapes=((4, 4), (4, 4)), dtypes=(F32, "float99")), "float99"),
])
def test_unreplayable_keys_raise_profile_error(key, match):
    with pytest.raises(ProfileError, match=match):
        replay_kernel(key, "cpu", policy=FAST)


def test_profile_kernels_skips_existing_unless_forced(tmp_path):
    fp = current_fingerprint("cpu")
    collective = KernelKey(op="c10d.allreduce_.default", input_shapes=((4,),), dtypes=(F32,))
    keys = [KEYS["mm"], KEYS["softmax"], KEYS["mm"], collective]
    with ProfileDB.open(tmp_path / "p.sqlite") as db:
        db.put_kernel(fp, KEYS["mm"], 1.0, 1, 0.0)
        summary = profile_kernels(keys, "cpu", db, fp, progress=False, policy=FAST)
        assert (summary.measured, summary.skipped) == (1, 1)
        assert [k for k, _ in summary.failed] == [collective]
        assert "c10d.allreduce_.default" in summary.failed[0][1]
        assert db.get_kernel(fp, KEYS["mm"]) == 1.0
        assert db.get_kernel(fp, KEYS["softmax"]) > 0
        summary = profile_kernels(keys, "cpu", db, fp, force=True, progress=False, policy=FAST)
        assert (summary.measured, summary.skipped, len(summary.failed)) == (2, 0, 1)
        assert db.get_kernel(fp, KEYS["mm"]) != 1.0


def test_profile_kernels_rejects_fingerprint_of_another_device_kind(tmp_path):
    h100 = DeviceFingerprint(kind=DeviceKind.CUDA, device_name="NVIDIA H100 80GB HBM3", sm_count_or_cores=132,
                             cpu_model="AMD EPYC 9654", torch_version="2.13.0", cuda_version="12.8")
    with ProfileDB.open(tmp_path / "p.sqlite") as db, pytest.raises(ProfileError, match="cuda device"):
        profile_kernels([KEYS["mm"]], "cpu", db, h100, progress=False)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_tty():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        with ProgressBar(3, "profiling", stream=stream) as bar:
            for _ in range(3):
                bar.advance(note="aten.mm.default")
    assert "3/3" in tty.getvalue() and "eta" in tty.getvalue() and tty.getvalue().endswith("\n")
    assert pipe.getvalue() == ""
    quiet = _Tty()
    with ProgressBar(3, "profiling", enabled=False, stream=quiet) as bar:
        bar.advance()
    assert quiet.getvalue() == ""


def test_matmul_operands_are_drawn_as_training_draws_them_and_other_inputs_stay_non_negative():
    torch.manual_seed(0)
    _, kwargs = build_call(KernelKey(op="aten.mm.default", input_shapes=((256, 256), (256, 256)), dtypes=(F32, F32)),
                           "cpu")
    a = kwargs["self"]
    assert a.min() < 0 < a.max() and abs(float(a.mean())) < 0.05 and abs(float(a.std()) - 1.0) < 0.05
    _, kwargs = build_call(KEYS["baddbmm"], "cpu")
    assert min(float(kwargs[n].min()) for n in ("batch1", "batch2")) < 0
    _, kwargs = build_call(KEYS["addcmul_"], "cpu")
    assert all(float(kwargs[n].min()) >= 0 for n in ("self", "tensor1", "tensor2"))
