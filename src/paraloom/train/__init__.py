"""Training: the one loop (loop.py), the strategies it runs (strategies/), and their helpers."""

from paraloom.train.loop import train

__all__ = ["train"]
