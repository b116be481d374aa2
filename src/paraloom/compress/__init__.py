"""Gradient compression: the Compressor protocol, its registry, and one algorithm per module.

Registered names: fp16, bf16, qsgd, onebit, efsign, topk, randomk, dgc; PowerSGD's math is
`paraloom.compress.powersgd.PowerSGDState` (a multi-round reducer). `ddp_hook(name, **options)`
runs any of them (and "powersgd") as a torch DDP communication hook.
"""

from paraloom.compress import dgc, fp16, qsgd, sign, topk  # noqa: F401 - importing registers them
from paraloom.compress.base import COMPRESSORS, Compressor, ErrorFeedback, make_compressor, register
from paraloom.compress.ddp import ddp_hook

__all__ = ["COMPRESSORS", "Compressor", "ErrorFeedback", "ddp_hook", "make_compressor", "register"]
