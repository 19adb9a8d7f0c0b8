"""Communication: where ranks sit, measured NCCL tables, and the time of each collective."""

from vtrain_plugin.comm.model import CommModel
from vtrain_plugin.comm.nccl_table import NcclTable, available_table_sets, load_table_set, parse_table
from vtrain_plugin.comm.topology import GroupPlacement, Layout

__all__ = ["CommModel", "GroupPlacement", "Layout", "NcclTable", "available_table_sets",
           "load_table_set", "parse_table"]
