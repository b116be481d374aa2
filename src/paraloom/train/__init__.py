"""Training: the one loop (loop.py), the strategies it runs (strategies/), and their helpers.

`train` loads on first use: a launcher imports the light helpers (stopping.py, the checkpoint records)
without the loop and the torch stack under it."""

from __future__ import annotations

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from paraloom.train.loop import train

        return train
    raise AttributeError(f"module 'paraloom.train' has no attribute {name!r}")
