import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.units import gbps_to_bytes_per_ns
from vtrain_plugin.hardware.clusters import cluster_preset_names, get_cluster_preset, resolve_cluster
from vtrain_plugin.specs.cluster import ClusterSpec

BASE = dict(gpu="a100-sxm4-80gb", intra_node_bandwidth_gbytes_per_s=300.0, intra_node_latency_us=1.0,
            inter_node_bandwidth_gbps=1600.0, inter_node_latency_us=5.0)


def test_presets_and_units():
    assert set(cluster_preset_names()) >= {"dgx-a100", "dgx-b200", "dgx-h100", "dgx-h200"}
    a100 = get_cluster_preset("dgx-a100")
    assert a100.gpus_per_node == 8 and a100.nccl_tables == "a100_sxm"
    assert a100.inter_node_bytes_per_ns == 200.0  # 8 x 200 Gb/s = 200 GB/s
    assert a100.intra_node_bytes_per_ns == 300.0
    assert a100.inter_node_latency_ns == 5000.0
    assert get_cluster_preset("dgx-h100").inter_node_bandwidth_gbps == 3200.0
    assert gbps_to_bytes_per_ns(400.0) == 50.0
    assert a100.num_nodes(3360) == 420 and a100.num_nodes(12) == 2


def test_host_copies_share_the_nodes_memory_bandwidth():
    # DGX H100: 2 x 307.2 GB/s of DDR5 for 8 GPUs copying both ways: 38.4 GB/s each, below PCIe Gen5's 64
    h100 = get_cluster_preset("dgx-h100")
    assert h100.host_memory_bandwidth_gbytes_per_s == 614.4
    assert h100.host_copy_gbytes_per_s(64.0) == pytest.approx(38.4)
    assert get_cluster_preset("dgx-a100").host_copy_gbytes_per_s(32.0) == pytest.approx(25.6)
    assert ClusterSpec(**BASE).host_copy_gbytes_per_s(32.0) == 32.0  # unknown: the host link alone
    assert ClusterSpec(**BASE, host_memory_bandwidth_gbytes_per_s=1024.0).host_copy_gbytes_per_s(32.0) == 32.0


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError, match=r"unknown cluster preset 'dgx-z'; valid presets are dgx-a100, dgx-b200, dgx-h100, dgx-h200, gb200-nvl72, gb300-nvl72"):
        get_cluster_preset("dgx-z")


@pytest.mark.parametrize("field, value, message", [
    ("gpus_per_node", 0, "cluster.gpus_per_node must be positive, got 0"),
    ("gpus_per_node", 8.0, "cluster.gpus_per_node must be a positive integer, got 8.0"),
    ("intra_node_bandwidth_gbytes_per_s", 0, "cluster.intra_node_bandwidth_gbytes_per_s must be positive, got 0"),
    ("inter_node_bandwidth_gbps", -1.0, "cluster.inter_node_bandwidth_gbps must be positive, got -1.0"),
    ("inter_node_latency_us", -1.0, "cluster.inter_node_latency_us must be a non-negative number, got -1.0"),
    ("price_per_gpu_hour_usd", -2.0, "cluster.price_per_gpu_hour_usd must be a non-negative number"),
    ("network_efficiency", 1.5, "cluster.network_efficiency must lie in [0.01, 1], got 1.5"),
    ("gpu", "", "cluster.gpu must be a non-empty device preset name"),
    ("host_memory_bandwidth_gbytes_per_s", 0.5, "cluster.host_memory_bandwidth_gbytes_per_s must lie in [1, 100,000], got 0.5"),
])
def test_validation_messages(field, value, message):
    with pytest.raises(ConfigError) as err:
        ClusterSpec(**{**BASE, field: value})
    assert message in str(err.value)


def test_sections_resolve_against_presets():
    spec = resolve_cluster({**BASE, "gpus_per_node": 4})
    assert spec.gpus_per_node == 4 and spec.nccl_tables == "a100_sxm" and spec.price_per_gpu_hour_usd == 2.0
    overridden = resolve_cluster({"preset": "dgx-a100", "inter_node_bandwidth_gbps": 800.0})
    assert overridden.inter_node_bandwidth_gbps == 800.0 and overridden.nccl_tables == "a100_sxm"
    assert resolve_cluster({"gpu": "H100"}) == get_cluster_preset("dgx-h100").__class__(
        **{**get_cluster_preset("dgx-h100").to_dict(), "name": ""})


def test_sections_reject_unknown_keys_and_table_sets():
    with pytest.raises(ConfigError, match=r"cluster: unknown key 'nvlink'; allowed keys are .*gpus_per_node"):
        resolve_cluster({**BASE, "nvlink": 1})
    with pytest.raises(ConfigError, match=r"cluster.nccl_tables must be one of a100_sxm; got 'v100'"):
        resolve_cluster({**BASE, "nccl_tables": "v100"})
    with pytest.raises(ConfigError, match="cluster must be a mapping"):
        resolve_cluster([1, 2])
