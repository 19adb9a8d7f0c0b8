"""Hardware as data: device spec sheets, cluster presets, calibration files and measured NCCL tables."""

from vtrain_plugin.hardware.calibration import Calibration, DeviceConstants, calibration_for, write_calibration
from vtrain_plugin.hardware.clusters import cluster_for_gpu, cluster_preset_names, get_cluster_preset, resolve_cluster
from vtrain_plugin.hardware.devices import DeviceSpec, get_device, known_devices
from vtrain_plugin.hardware.nccl import NcclTable, available_table_sets, load_table_set

__all__ = ["Calibration", "DeviceConstants", "DeviceSpec", "NcclTable", "available_table_sets", "calibration_for",
           "cluster_for_gpu", "cluster_preset_names", "get_cluster_preset", "get_device", "known_devices",
           "load_table_set", "resolve_cluster", "write_calibration"]
