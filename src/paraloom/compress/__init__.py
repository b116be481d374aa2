"""Gradient compression: the Compressor protocol, its registry, and one algorithm per module."""

from paraloom.compress.base import COMPRESSORS, Compressor, ErrorFeedback, make_compressor, register

__all__ = ["COMPRESSORS", "Compressor", "ErrorFeedback", "make_compressor", "register"]
