"""Kernel durations: which class of kernel an op runs, the analytical model per class, measured
durations from a profile, the host/device pipeline that issues them, and the slowest-GPU factor.
"""

from vtrain_plugin.cost.kernels.model import KernelBatch, KernelModel
from vtrain_plugin.cost.kernels.op_classes import OpClass, classify
from vtrain_plugin.cost.kernels.timer import KernelTimer

__all__ = ["KernelBatch", "KernelModel", "KernelTimer", "OpClass", "classify"]
