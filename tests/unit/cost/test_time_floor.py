"""The time floor's collective rates hold for the measured NCCL tables the package ships: every table
point of a cluster's set is at least the all-reduce the floor counts (ring size term at the NVLink
rate plus the ring steps' NVLink latency), so the tables' interpolation between and beyond their
points, from that latency at zero bytes, is too."""

from pathlib import Path

import pytest

import vtrain_plugin.hardware as hardware
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.hardware.nccl import load_table_set

PRESETS = sorted(p.stem for p in (Path(hardware.__file__).parent / "data" / "clusters").glob("*.json"))
WITH_TABLES = [name for name in PRESETS if get_cluster_preset(name).nccl_tables is not None]


@pytest.mark.parametrize("name", WITH_TABLES)
def test_every_shipped_table_point_takes_at_least_the_floors_all_reduce(name):
    cluster = get_cluster_preset(name)
    for gpus, table in load_table_set(cluster.nccl_tables).items():
        steps = 2 * (gpus - 1)
        for nbytes, ns in zip(table.sizes_nbytes, table.times_ns):
            floor_ns = steps / gpus * nbytes / cluster.intra_node_bytes_per_ns + steps * cluster.intra_node_latency_ns
            assert ns >= floor_ns, (gpus, nbytes, ns, floor_ns)


def test_a_cluster_ships_tables():
    assert WITH_TABLES
