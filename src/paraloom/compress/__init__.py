"""Gradient compression: the Compressor protocol, its registry, and one algorithm per module.

Registered names: fp16, bf16, qsgd, onebit, efsign, topk, randomk, dgc; PowerSGD's math is
`paraloom.compress.powersgd.PowerSGDState` (a multi-round reducer). Not yet wired into the
data-parallel engine or a DDP hook (issue 5).
"""

from paraloom.compress import dgc, fp16, qsgd, sign, topk  # noqa: F401 - importing registers them
from paraloom.compress.base import COMPRESSORS, Compressor, ErrorFeedback, make_compressor, register

__all__ = ["COMPRESSORS", "Compressor", "ErrorFeedback", "make_compressor", "register"]
