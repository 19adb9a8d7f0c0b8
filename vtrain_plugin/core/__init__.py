"""The bottom layer: the op graph, errors, dtypes, units, op names, registries, checks."""

from vtrain_plugin.core.dtypes import Dtype, canonical_dtype, element_nbytes
from vtrain_plugin.core.errors import ConfigError, ProfileError, TraceError, VTrainError
from vtrain_plugin.core.files import atomic_write_text
from vtrain_plugin.core.graph import (Block, BlockKind, CollectiveKind, CollectiveNode, KernelKey, Node, OpGraph,
                                      OpNode, ParallelGroup, Phase, StageGraph, UniqueKernel)
from vtrain_plugin.core.op_names import OpName, parse_op_name
from vtrain_plugin.core.registry import Registry

__all__ = ["Block", "BlockKind", "CollectiveKind", "CollectiveNode", "ConfigError", "Dtype", "KernelKey", "Node",
           "OpGraph", "OpName", "OpNode", "ParallelGroup", "Phase", "ProfileError", "Registry", "StageGraph",
           "TraceError", "UniqueKernel", "VTrainError", "atomic_write_text", "canonical_dtype", "element_nbytes",
           "parse_op_name"]
