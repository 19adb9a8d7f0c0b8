"""From traced ops to the kernels a software stack runs: one module per stack (Megatron-DeepSpeed
2023, Megatron-Core + TransformerEngine), the FP8 pass, the shared fusion rules, and what
TransformerEngine keeps for backward. :func:`map_nodes` picks the stack's mapping from its registry.
"""

from vtrain_plugin.cost.lowering.stacks import FP8_STACKS, map_nodes, register_stack

__all__ = ["FP8_STACKS", "map_nodes", "register_stack"]
