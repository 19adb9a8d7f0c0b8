import numpy as np
import pytest

from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.cluster import ClusterSpec
from vtrain_plugin.cost import CommModel, Layout
from vtrain_plugin.cost.comm.collectives import measured_latency
from vtrain_plugin.hardware.nccl import NcclTable, load_table_set, parse_table
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import CollectiveKind as K
from vtrain_plugin.core.graph import ParallelGroup as G

# 100 GB/s NVLink (100 bytes/ns), 400 Gb/s per node (50 bytes/ns, 6.25 per GPU), 2 us / 5 us per step.
PLAIN = ClusterSpec(gpu="a100-sxm4-80gb", gpus_per_node=8, intra_node_bandwidth_gbytes_per_s=100.0,
                    intra_node_latency_us=2.0, inter_node_bandwidth_gbps=400.0, inter_node_latency_us=5.0)


def comm(tp=1, pp=1, dp=1, cluster=PLAIN):
    return CommModel(cluster=cluster, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp)


# -- topology ---------------------------------------------------------------------------------------

def test_megatron_rank_order():
    layout = Layout(tensor_parallel=8, pipeline_parallel=16, data_parallel=4, gpus_per_node=8)
    assert layout.rank(tp_rank=1, dp_rank=2, pp_rank=3) == 1 + 8 * (2 + 4 * 3)
    assert layout.world_size == 512 and layout.num_nodes == 64
    with pytest.raises(ConfigError, match=r"dp_rank must be in \[0, 4\), got 4"):
        layout.rank(dp_rank=4)


def test_placement_tp8_dp4_pp16():
    layout = Layout(tensor_parallel=8, pipeline_parallel=16, data_parallel=4, gpus_per_node=8)
    tp, dp, pp = (layout.placement(g) for g in (G.TP, G.DP, G.PP))
    assert (tp.size, tp.num_nodes, tp.gpus_per_node, tp.spans_nodes) == (8, 1, 8, False)
    assert (dp.size, dp.num_nodes, dp.gpus_per_node) == (4, 4, 1)
    assert (pp.size, pp.num_nodes, pp.gpus_per_node) == (16, 16, 1)
    emb = layout.placement(G.EMBEDDING)
    assert (emb.size, emb.num_nodes) == (2, 2)
    assert layout.placement(G.DP, pipeline_rank=5) == dp


def test_placement_partial_nodes():
    layout = Layout(tensor_parallel=2, pipeline_parallel=1, data_parallel=8, gpus_per_node=8)
    dp = layout.placement(G.DP)  # ranks 0, 2, ..., 14
    assert (dp.num_nodes, dp.gpus_per_node, dp.max_gpus_per_node) == (2, 4, 4)
    uneven = Layout(tensor_parallel=3, pipeline_parallel=1, data_parallel=4, gpus_per_node=8).placement(G.DP)
    assert (uneven.num_nodes, uneven.gpus_per_node, uneven.max_gpus_per_node) == (2, 1, 3)  # 0,3,6 | 9
    wide = Layout(tensor_parallel=1, pipeline_parallel=1, data_parallel=4096, gpus_per_node=8).placement(G.DP)
    assert (wide.num_nodes, wide.gpus_per_node) == (512, 8)
    single = Layout(tensor_parallel=8, pipeline_parallel=1, data_parallel=2, gpus_per_node=8)
    assert single.placement(G.EMBEDDING).size == 1 and single.placement(G.PP).size == 1


def test_p2p_crosses_nodes():
    layout = Layout(tensor_parallel=2, pipeline_parallel=8, data_parallel=1, gpus_per_node=8)
    assert not layout.p2p_crosses_nodes(0)  # rank 0 -> 2
    assert layout.p2p_crosses_nodes(3)  # rank 6 -> 8
    assert layout.p2p_crosses_nodes(7)  # wrap-around 14 -> 0 (interleaved hand-over)


# -- alpha-beta -------------------------------------------------------------------------------------

def test_ring_formulas_intra_node():
    m = comm(tp=4)
    assert m.time_ns(K.ALL_REDUCE, 4_000_000, G.TP) == 2 * 3 / 4 * 4_000_000 / 100 + 6 * 2000  # 72000
    assert m.time_ns(K.ALL_GATHER, 4_000_000, G.TP) == 3 / 4 * 4_000_000 / 100 + 3 * 2000
    assert m.time_ns(K.REDUCE_SCATTER, 4_000_000, G.TP) == 36000.0
    assert m.time_ns(K.BROADCAST, 4_000_000, G.TP) == 4_000_000 / 100 + 3 * 2000
    assert m.time_ns(K.ALL_TO_ALL, 4_000_000, G.TP) == 3 / 4 * 4_000_000 / 100 + 3 * 2000


def test_group_of_one_and_empty_message_cost_nothing():
    m = comm(tp=1, dp=8)
    assert m.time_ns(K.ALL_REDUCE, 10**9, G.TP) == 0.0
    assert m.time_ns(K.ALL_REDUCE, 0, G.DP) == 0.0
    assert m.time_ns(K.ALL_REDUCE, 10**6, G.EMBEDDING) == 0.0  # pp = 1
    with pytest.raises(ConfigError, match="nbytes must be a non-negative integer, got -1"):
        m.time_ns(K.ALL_REDUCE, -1, G.DP)


def test_cross_node_tp_is_slower_than_intra_node():
    nbytes = 16_000_000
    intra = comm(tp=8).time_ns(K.ALL_REDUCE, nbytes, G.TP)
    cross = comm(tp=16).time_ns(K.ALL_REDUCE, nbytes, G.TP)
    assert cross > intra
    # 8 GPUs of the group per node use 8 NIC shares: B = min(100, 8 * 50 / 8) = 50 bytes/ns;
    # 30 ring steps, 2 of them across the network; the ring beats the tree here.
    assert cross == 2 * 15 / 16 * nbytes / 50 + 28 * 2000 + 2 * 5000
    assert intra == 2 * 7 / 8 * nbytes / 100 + 14 * 2000


def test_dp_across_nodes_uses_one_nic_share_per_gpu():
    m = comm(tp=8, dp=4)
    assert m.time_ns(K.ALL_REDUCE, 8_000_000, G.DP) == 2 * 3 / 4 * 8_000_000 / 6.25 + 6 * 5000


def test_tree_wins_when_latency_bound():
    m = comm(dp=64)  # 8 nodes of 8
    ring = 2 * 63 / 64 * 1000 / 50 + 112 * 2000 + 14 * 5000
    tree = 1000 / (0.5 * 0.92 * 50) + 2 * (7 * 2000 + 3 * 5000)
    assert m.time_ns(K.ALL_REDUCE, 1000, G.DP) == pytest.approx(tree)
    assert tree < ring


def test_send_recv():
    m = comm(tp=2, pp=8)
    assert m.send_recv_ns(1_000_000, across_nodes=False) == 1_000_000 / 100 + 2000
    assert m.send_recv_ns(1_000_000, across_nodes=True) == 1_000_000 / 6.25 + 5000
    assert m.time_ns(K.SEND, 1_000_000, G.PP, pipeline_rank=3) == m.send_recv_ns(1_000_000, across_nodes=True)
    assert m.time_ns(K.RECV, 1_000_000, G.PP, pipeline_rank=0) == m.send_recv_ns(1_000_000, across_nodes=False)


# -- measured tables --------------------------------------------------------------------------------

def test_table_is_exact_at_table_points_and_interpolates():
    table = load_table_set("a100_sxm")[8]
    assert sorted(load_table_set("a100_sxm")) == [2, 3, 4, 5, 6, 7, 8]
    assert table.sizes_nbytes[0] == 1 << 20
    assert table.time_ns(1 << 20) == (92790 + 92150) / 2
    mid = table.time_ns(3 << 19)  # half-way between 1 MiB and 2 MiB
    assert mid == ((92790 + 92150) / 2 + (93250 + 92970) / 2) / 2
    last_size, last_time = table.sizes_nbytes[-1], table.times_ns[-1]
    assert table.time_ns(2 * last_size) == 2 * last_time  # edge algorithm bandwidth


def test_table_below_first_point_keeps_latency_floor():
    table = NcclTable(num_gpus=2, sizes_nbytes=(100, 200), times_ns=(50.0, 60.0))
    assert table.time_ns(50, latency_floor_ns=10.0) == 30.0
    assert table.time_ns(50) == 25.0
    assert table.time_ns(0) == 0.0
    assert table.time_ns(150) == 55.0


def test_comm_model_uses_tables_inside_a_node():
    a100 = get_cluster_preset("dgx-a100")
    m = comm(tp=8, dp=2, cluster=a100)
    measured = (92790 + 92150) / 2
    assert m.time_ns(K.ALL_REDUCE, 1 << 20, G.TP) == measured
    assert m.time_ns(K.ALL_GATHER, 1 << 20, G.TP) == measured / 2
    assert m.time_ns(K.REDUCE_SCATTER, 1 << 20, G.TP) == measured / 2
    # across nodes: alpha-beta (8 NIC shares of 25 GB/s = 200 bytes/ns)
    assert m.time_ns(K.ALL_REDUCE, 1 << 20, G.DP) == 2 * 1 / 2 * (1 << 20) / 25 + (measured_latency("a100_sxm")[0] + 0 + 2 * 5000)
    # a 16-GPU node has no 16-GPU table: alpha-beta
    big_node = ClusterSpec(**{**a100.to_dict(), "gpus_per_node": 16, "name": "x"})
    assert comm(tp=16, cluster=big_node).time_ns(K.ALL_REDUCE, 1600, G.TP) == 2 * 15 / 16 * 1600 / 300 + 30 * 1000


def test_parse_table_errors_name_the_file():
    header = "size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)"
    table = parse_table(f"{header}\n1024,256,float,10,1,20,1\n", num_gpus=2, where="t.csv")
    assert table.times_ns == (15.0,)
    with pytest.raises(ConfigError, match=r"t.csv: first line must be the header"):
        parse_table("size,time\n", num_gpus=2, where="t.csv")
    with pytest.raises(ConfigError, match=r"t.csv:2: expected 7 comma-separated columns, got 3"):
        parse_table(f"{header}\n1,2,3\n", num_gpus=2, where="t.csv")
    with pytest.raises(ConfigError, match=r"t.csv: nccl_table.sizes_nbytes must be positive and strictly increasing"):
        parse_table(f"{header}\n2,1,f,1,1,1,1\n1,1,f,1,1,1,1\n", num_gpus=2, where="t.csv")
    with pytest.raises(ConfigError, match=r"cluster.nccl_tables must be one of a100_sxm; got 'nope'"):
        load_table_set("nope")


def test_network_efficiency_scales_every_network_transfer():
    full, half = comm(tp=8, dp=4), CommModel(cluster=PLAIN, tensor_parallel=8, pipeline_parallel=1, data_parallel=4,
                                             network_efficiency=0.5)
    assert half.time_ns(K.ALL_REDUCE, 8_000_000, G.DP) == 2 * 3 / 4 * 8_000_000 / 3.125 + 6 * 5000
    assert half.send_recv_ns(1_000_000, across_nodes=True) == 1_000_000 / 3.125 + 5000
    assert half.send_recv_ns(1_000_000, across_nodes=False) == full.send_recv_ns(1_000_000, across_nodes=False)
    with pytest.raises(ConfigError, match=r"network_efficiency must lie in \(0, 1\], got 1.5"):
        CommModel(cluster=PLAIN, tensor_parallel=1, pipeline_parallel=1, data_parallel=1, network_efficiency=1.5)


def test_table_zero_byte_time_extrapolates_the_first_two_points():
    table = load_table_set("a100_sxm")[8]
    t0, t1 = (92790 + 92150) / 2, (93250 + 92970) / 2  # 1 MiB and 2 MiB
    assert table.zero_byte_ns == t0 - (t1 - t0)  # 91,830 ns
    assert NcclTable(num_gpus=2, sizes_nbytes=(100, 200), times_ns=(50.0, 60.0)).zero_byte_ns == 40.0
    assert NcclTable(num_gpus=2, sizes_nbytes=(100, 200), times_ns=(10.0, 60.0)).zero_byte_ns == 0.0  # clamped
    assert NcclTable(num_gpus=2, sizes_nbytes=(100,), times_ns=(7.0,)).zero_byte_ns == 7.0


def test_measured_latency_is_the_tables_zero_byte_line():
    tables = load_table_set("a100_sxm")
    steps = [2 * (g - 1) for g in sorted(tables)]
    slope, intercept = np.polyfit(steps, [tables[g].zero_byte_ns for g in sorted(tables)], 1)
    fixed, per_step = measured_latency("a100_sxm")
    assert (fixed, per_step) == (pytest.approx(intercept, rel=1e-9), pytest.approx(slope, rel=1e-9))
    assert (round(fixed), round(per_step)) == (30908, 4102)  # per collective, per NVLink ring step


def test_node_spanning_group_pays_the_measured_intra_node_latency():
    # TP 16 on two DGX A100 nodes: 8 GPUs of the group per node, 8 NIC shares of 25 GB/s = 200 bytes/ns.
    # Of the ring's 30 steps, 28 stay inside a node at the tables' per-step latency, 2 cross the
    # network at 5 us, plus the tables' per-collective fixed cost; reduce-scatter has 14 + 1 steps.
    a100 = get_cluster_preset("dgx-a100")
    fixed, step = measured_latency("a100_sxm")
    m = comm(tp=16, cluster=a100)
    nbytes = 402_653_184  # 32 x 2048 x 3072 fp16: a micro-batch 32 activation
    assert m.time_ns(K.ALL_REDUCE, nbytes, G.TP) == 2 * 15 / 16 * nbytes / 200 + (fixed + 28 * step + 2 * 5000)
    # at micro-batch 2 (25 MB) the tree's shorter intra-node chain (7 steps each way) wins
    small = 25_165_824
    assert m.time_ns(K.ALL_REDUCE, small, G.TP) == small / (0.5 * 0.92 * 200) + (fixed + 2 * (7 * step + 1 * 5000))
    assert m.time_ns(K.REDUCE_SCATTER, nbytes, G.TP) == 15 / 16 * nbytes / 200 + (fixed + 14 * step + 1 * 5000)
    # the tree's intra-node chain too: 1 KB on 8 nodes x 8 GPUs (DP 64) is latency-bound, the tree wins
    dp = comm(dp=64, cluster=a100)
    assert dp.time_ns(K.ALL_REDUCE, 1000, G.DP) == 1000 / (0.5 * 0.92 * 200) + (fixed + 2 * (7 * step + 3 * 5000))
    # one GPU of the group per node (DP with TP 8): no intra-node steps, the fixed cost only
    assert comm(tp=8, dp=2, cluster=a100).time_ns(K.ALL_REDUCE, 1 << 20, G.DP) == (1 << 20) / 25 + (fixed + 0 * step + 2 * 5000)
    # inside a node nothing changes: the table itself
    assert comm(tp=8, cluster=a100).time_ns(K.ALL_REDUCE, 1 << 20, G.TP) == (92790 + 92150) / 2


# -- NVLink domains of several nodes (GB200 NVL72) ---------------------------------------------------

NVL72 = get_cluster_preset("gb200-nvl72")  # trays of 4, racks of 72; 900 bytes/ns NVLink, 1 us / 5 us per step


def test_nvl72_tp8_spans_two_trays_at_nvlink_rate():
    """TP 8 takes trays 0 and 1 of rack 0: NVLink switches join them, so the ring runs at 900 bytes/ns
    with NVLink latencies, where nodes of 4 without a rack-wide domain would cross the network."""
    nbytes = 900_000_000
    tp8 = CommModel(cluster=NVL72, tensor_parallel=8, pipeline_parallel=1, data_parallel=18)
    assert not tp8.placement(G.TP).spans_nodes
    assert tp8.time_ns(K.ALL_REDUCE, nbytes, G.TP) == pytest.approx(2 * 7 / 8 * nbytes / 900 + 14 * 1_000)
    trays_alone = CommModel(cluster=ClusterSpec(**{**NVL72.to_dict(), "nvlink_domain_gpus": None}),
                            tensor_parallel=8, pipeline_parallel=1, data_parallel=18)
    assert trays_alone.placement(G.TP).spans_nodes
    assert trays_alone.time_ns(K.ALL_REDUCE, nbytes, G.TP) > 2 * tp8.time_ns(K.ALL_REDUCE, nbytes, G.TP)


def test_nvl72_ep64_all_to_all_inside_the_rack():
    nbytes = 64_000_000
    ep64 = CommModel(cluster=NVL72, tensor_parallel=1, pipeline_parallel=1, data_parallel=128, expert_parallel=64)
    assert ep64.placement(G.EP).num_nodes == 1
    assert ep64.time_ns(K.ALL_TO_ALL, nbytes, G.EP) == pytest.approx(63 / 64 * nbytes / 900 + 63 * 1_000)


def test_nvl72_dp_across_racks_on_one_nic_per_gpu():
    """TP 72 fills a rack; DP 2 pairs rank 0 with rank 72 in the next rack: one GPU per rack, one
    400 Gb/s NIC share (1600 Gb/s per tray of 4 = 50 bytes/ns per GPU), two network ring steps."""
    nbytes = 100_000_000
    dp = CommModel(cluster=NVL72, tensor_parallel=72, pipeline_parallel=1, data_parallel=2)
    placement = dp.placement(G.DP)
    assert (placement.num_nodes, placement.gpus_per_node) == (2, 1)
    assert dp.time_ns(K.ALL_REDUCE, nbytes, G.DP) == pytest.approx(nbytes / 50 + 2 * 5_000)
    assert dp.send_recv_ns(nbytes, across_nodes=True) == pytest.approx(nbytes / 50 + 5_000)


def test_nvlink_domain_must_hold_whole_nodes():
    with pytest.raises(ConfigError, match=r"^cluster.nvlink_domain_gpus \(70\) must be a multiple of "
                                          r"cluster.gpus_per_node \(4\)"):
        ClusterSpec(**{**NVL72.to_dict(), "nvlink_domain_gpus": 70})


def test_tp_dp_cp_group_is_every_rank_of_a_pipeline_stage():
    layout = Layout(tensor_parallel=2, pipeline_parallel=2, data_parallel=4, context_parallel=2, gpus_per_node=8)
    stage = layout.placement(G.TP_DP_CP, pipeline_rank=1)  # ranks 16..31: two whole nodes
    assert (stage.size, stage.num_nodes, stage.gpus_per_node, stage.max_gpus_per_node) == (16, 2, 8, 8)
    # pipeline ranks between CP and DP: TP x CP consecutive (0..3), DP 8 ranks apart (0, 8, 16, 24)
    mapped = Layout(tensor_parallel=2, pipeline_parallel=2, data_parallel=4, context_parallel=2, gpus_per_node=8,
                    tp_pp_dp_mapping=True).placement(G.TP_DP_CP)
    assert (mapped.size, mapped.num_nodes, mapped.gpus_per_node, mapped.max_gpus_per_node) == (16, 4, 4, 4)
