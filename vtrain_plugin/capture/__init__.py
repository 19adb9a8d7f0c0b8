"""``trace()``: capturing a real model's operators and collectives into an OpGraph."""

from vtrain_plugin.capture.tracer import clear_cache, trace, trace_stage

__all__ = ["clear_cache", "trace", "trace_stage"]
