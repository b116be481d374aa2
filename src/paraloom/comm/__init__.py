"""Communication: timed collectives with byte accounting."""

from paraloom.comm.collectives import CommStats, all_reduce, broadcast

__all__ = ["CommStats", "all_reduce", "broadcast"]
