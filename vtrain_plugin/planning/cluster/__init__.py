"""Shared-cluster scheduling driven by vtrain's throughput curves (``vtrain cluster-sim``)."""
