"""Emulated clusters for the benchmark scripts, each under a name that no cluster up now has."""

from __future__ import annotations

from paraloom.cluster import ClusterSpec, EmulatedCluster, free_name

__all__ = ["emulated", "free_name"]


def emulated(nodes: int, rate_bits: float, prefix: str) -> EmulatedCluster:
    """`nodes` nodes on links of `rate_bits` (whole Mbit/s) under a free name; bring it up with `with`."""
    rate = max(1, round(rate_bits / 10**6)) * 10**6
    return EmulatedCluster(ClusterSpec(nodes=nodes, rate_bits=rate, name=free_name(prefix)))
