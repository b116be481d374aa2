"""Data sets as in-memory tensors, and deterministic per-rank batch sharding."""

from __future__ import annotations

from paraloom.data.digits import load_digits
from paraloom.data.sharding import ShardedBatches
from paraloom.data.split import Split
from paraloom.data.synthetic import make_synthetic
from paraloom.data.text import load_text, unigram_loss
from paraloom.errors import UserError

DATASETS = {"digits": load_digits, "synthetic": make_synthetic, "text": load_text}


def load_dataset(name: str, **kwargs) -> Split:
    if name not in DATASETS:
        raise UserError(f"data set {name!r} is not known; choose one of: {', '.join(DATASETS)}")
    return DATASETS[name](**kwargs)


__all__ = ["DATASETS", "ShardedBatches", "Split", "load_dataset", "load_digits", "load_text",
           "make_synthetic", "unigram_loss"]
