"""The merged forward-backward steps of megatron-core's EP all-to-all overlap, exact."""

import pytest

from vtrain_plugin.cost.comm.ep_overlap import OverlapParts, merged_pair_ns, pair_saving_ns, steady_pairs

PARTS = OverlapParts(forward_other_ns=100, forward_moe_ns=60, backward_other_ns=200, backward_moe_ns=120,
                     backward_expert_gemm_ns=80, ep_forward_ns=160, ep_backward_ns=240)


def test_four_steps_each_the_longer_of_comm_and_compute():
    # steps: max(120, 100) + max(80, 120) + max(120, 60) + max(80, 200)
    assert merged_pair_ns(PARTS, delay_wgrad=False, comm_sm_share=0.0) == 120 + 120 + 120 + 200
    # delayed: 40 ns of weight gradients move from step 2 to step 3: max(80, 80) + max(120, 100)
    assert merged_pair_ns(PARTS, delay_wgrad=True, comm_sm_share=0.0) == 120 + 80 + 120 + 200
    # the dispatch kernels' SMs: compute beside a comm of c takes share * c longer
    assert merged_pair_ns(PARTS, delay_wgrad=False, comm_sm_share=0.25) == 130 + 140 + 120 + 220
    alone = 100 + 60 + 200 + 120 + 160 + 240
    assert pair_saving_ns(PARTS, delay_wgrad=True, comm_sm_share=0.0) == alone - 520


def test_steady_pairs_leave_out_the_warm_up():
    assert steady_pairs(pipeline_parallel=1, virtual_pipeline=1, num_microbatches=8, pipeline_rank=0) == 7 / 8
    # interleaved pp 4, vp 2, m 8: rank 0 warms up (4-0-1)*2 + 1*4 = 10 of 16 forwards
    assert steady_pairs(pipeline_parallel=4, virtual_pipeline=2, num_microbatches=8, pipeline_rank=0) == 6 / 16
    assert steady_pairs(pipeline_parallel=4, virtual_pipeline=2, num_microbatches=8, pipeline_rank=3) == pytest.approx(12 / 16)
