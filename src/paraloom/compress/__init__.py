"""Gradient compression: the Compressor protocol, its registry, and one algorithm per module.

The names and the module that implements each are `paraloom.config.choices.COMPRESSOR_MODULES`;
importing this package imports those modules, whose `@register(name)` classes fill
`COMPRESSORS`. PowerSGD's math is `paraloom.compress.powersgd.PowerSGDState` (a multi-round
reducer, not a compress/decompress pair). `ddp_hook(name, **options)` runs any of them (and
"powersgd") as a torch DDP communication hook.
"""

import importlib

from paraloom.compress.base import COMPRESSORS, Compressor, ErrorFeedback, make_compressor, register
from paraloom.compress.ddp import ddp_hook
from paraloom.config.choices import COMPRESSOR_MODULES

for _module in sorted(set(COMPRESSOR_MODULES.values())):
    importlib.import_module(f"paraloom.compress.{_module}")

__all__ = ["COMPRESSORS", "Compressor", "ErrorFeedback", "ddp_hook", "make_compressor", "register"]
