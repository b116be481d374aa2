"""Data sets (the zoo's in-memory tensors and users' own), and deterministic per-rank batch sharding."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from paraloom.config.errors import UserError
from paraloom.config.rules import is_factory
from paraloom.data.digits import load_digits
from paraloom.data.sampler import ShardBatch, ShardedBatchSampler
from paraloom.data.sharding import ShardedBatches
from paraloom.data.split import Split
from paraloom.data.synthetic import make_synthetic
from paraloom.data.text import load_text, unigram_loss
from paraloom.data.user import (
    LOSSES,
    DataSets,
    TensorPairs,
    collate,
    load_user_data,
    split_datasets,
)

if TYPE_CHECKING:
    from paraloom.config import Config

DATASETS = {"digits": load_digits, "synthetic": make_synthetic, "text": load_text}


def load_dataset(name: str, **kwargs) -> Split:
    if name not in DATASETS:
        raise UserError(f"data set {name!r} is not known; choose one of: {', '.join(DATASETS)}")
    return DATASETS[name](**kwargs)


def load_data(cfg: Config) -> DataSets:
    """The training and evaluation sets `data.*` names: a user's factory, or a built-in data set."""
    if is_factory(cfg.data.name):
        return load_user_data(cfg.data.name, cfg.data.options)
    kwargs = dataclasses.asdict(cfg.data)
    for key in ("name", "options", "workers"):
        kwargs.pop(key)
    return split_datasets(load_dataset(cfg.data.name, **kwargs))


__all__ = ["DATASETS", "LOSSES", "DataSets", "ShardBatch", "ShardedBatchSampler", "ShardedBatches", "Split",
           "TensorPairs", "collate", "load_data", "load_dataset", "load_digits", "load_text",
           "load_user_data", "make_synthetic", "split_datasets", "unigram_loss"]
