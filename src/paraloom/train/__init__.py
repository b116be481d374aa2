"""Training: the worker's loop, its metrics and progress display."""

from paraloom.train.trainer import train

__all__ = ["train"]
