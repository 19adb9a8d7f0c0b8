"""Unit constants and the conversions done once where input is parsed.

Durations are nanoseconds and sizes bytes throughout the package; names say the unit
(``duration_ns``, ``nbytes``, ``bandwidth_gbps`` in Gbit/s, ``bandwidth_gbytes_per_s`` in GB/s).
"""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30
MEGABYTE = 10**6  # decimal: gradient bucket sizes are given in MB as Megatron's --ddp-bucket-size

NS_PER_US = 1e3
NS_PER_MS = 1e6
NS_PER_S = 1e9
MS_PER_S = 1e3
SECONDS_PER_MINUTE = 60.0
SECONDS_PER_HOUR = 3600.0
GBYTE = 10**9  # decimal, as storage and link bandwidths are quoted
SECONDS_PER_DAY = 86400.0


def gbytes_per_s_to_bytes_per_ns(gbytes_per_s: float) -> float:
    """GB/s (10^9 bytes per second) is exactly one byte per nanosecond."""
    return gbytes_per_s


def gbps_to_bytes_per_ns(gbps: float) -> float:
    """Gbit/s (10^9 bits per second) to bytes per nanosecond."""
    return gbps / 8.0


def tflop_per_s_to_flop_per_ns(tflop_per_s: float) -> float:
    """1 TFLOP/s (10^12 FLOP per second) is 10^3 FLOP per nanosecond."""
    return tflop_per_s * 1e3
