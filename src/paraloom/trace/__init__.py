"""Tracing: Chrome-trace timelines per rank (open in https://ui.perfetto.dev) and their plots."""

from importlib import import_module
from typing import Any

__all__ = ["Timeline", "trace_modules"]

_LAZY = {"Timeline": "paraloom.trace.timeline", "trace_modules": "paraloom.trace.timeline"}  # import torch


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paraloom.trace' has no attribute {name!r}")
