"""Everything that imports megatron.core: models built from its own specs on a fake process group,
the CPU and fake-mode stand-ins, a built model or config read as specs, the real one-device step.

Why one package: megatron-core loads torch and takes seconds to import, so vtrain_plugin imports
these modules only where a trace or a measured run needs them (import-linter keeps it so).
"""
