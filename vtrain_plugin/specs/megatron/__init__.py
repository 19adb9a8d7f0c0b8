"""The Megatron-LM reader: launch scripts read as bash without running them, the table of
Megatron-LM's arguments, and the model, plan and training they describe as vtrain specs.
"""

from vtrain_plugin.specs.megatron.args import MegatronPlan, megatron_plan, parse_flags, script_plan
from vtrain_plugin.specs.megatron.launch_script import (LaunchCommand, read_command_line, read_launch_file,
                                                        read_launch_script)

__all__ = ["LaunchCommand", "MegatronPlan", "megatron_plan", "parse_flags", "read_command_line", "read_launch_file",
           "read_launch_script", "script_plan"]
