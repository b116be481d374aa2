"""User data sets: `data.name=package.module:factory` -> DataSets, and the zoo's Split as the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from paraloom.config.errors import UserError
from paraloom.data.split import Split
from paraloom.factories import call_factory

LOSSES = ("classification", "next_token", "model")
# classification: output (B, C) vs integer targets (B,); next_token: output (B, T, V) vs targets (B, T);
# model: the model returns the loss itself, given (x, y)


def _refuse_unless_map_style(role: str, dataset: Any) -> None:
    if isinstance(dataset, IterableDataset):
        raise UserError(f"the {role} set is an IterableDataset; give a map-style Dataset (with "
                        "__getitem__ and __len__) so each rank can take its own samples by index")
    getitem = getattr(type(dataset), "__getitem__", None)
    if getitem is None or getitem is Dataset.__getitem__ or not hasattr(type(dataset), "__len__"):
        raise UserError(f"the {role} set (type {type(dataset).__name__}) is not a map-style Dataset; "
                        "give one with __getitem__ and __len__")
    if len(dataset) < 1:
        raise UserError(f"the {role} set is empty")


@dataclass(frozen=True)
class DataSets:
    """Training and evaluation sets (map-style Datasets) and what the loss compares (`LOSSES`)."""

    train: Dataset
    eval: Dataset
    loss: str = "classification"
    n_classes: int | None = None  # classes (or vocabulary) when known; models may size their head by it

    def __post_init__(self) -> None:
        _refuse_unless_map_style("training", self.train)
        _refuse_unless_map_style("evaluation", self.eval)
        if self.loss not in LOSSES:
            raise UserError(f"loss {self.loss!r} is not known; choose one of: {', '.join(LOSSES)}")
        n = self.n_classes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UserError(f"n_classes={n!r} must be a positive whole number or None")


def _as_datasets(made: Any) -> DataSets:
    if isinstance(made, DataSets):
        return made
    if isinstance(made, tuple) and len(made) in (2, 3):
        return DataSets(*made)
    raise UserError(f"the factory returned type {type(made).__name__}; return DataSets(train, eval, "
                    "loss) or a (train, eval) or (train, eval, loss) tuple of map-style Datasets")


def load_user_data(target: str, options: dict[str, Any]) -> DataSets:
    """Import `package.module:factory`, call it with `options`, and check it returned DataSets."""
    made = call_factory("data.name", target, options, returns="DataSets")
    try:
        return _as_datasets(made)
    except UserError as exc:
        raise UserError(f"data.name={target!r}: {exc}") from None


class _Ready(tuple):
    """A batch already gathered by TensorPairs.__getitems__: `collate` passes it through."""


class TensorPairs(Dataset):
    """Samples (x[i], y[i]) of two in-memory tensors; a batch comes out of one indexing op."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> _Ready:
        # torch's map-style fetcher calls this with the batch's index list when it exists, then
        # hands the result to collate_fn: one gather instead of len(indices) items to stack
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.x.device)
        return _Ready((self.x[idx], self.y[idx]))


def collate(batch: Any) -> Any:
    """DataLoader collate_fn: a batch TensorPairs gathered passes through, else default_collate."""
    if isinstance(batch, _Ready):
        return list(batch)  # a list, as default_collate gives for (x, y) samples
    return default_collate(batch)


def split_datasets(split: Split) -> DataSets:
    """The zoo's in-memory Split as DataSets: next_token when targets are sequences, else classification."""
    return DataSets(TensorPairs(split.x_train, split.y_train), TensorPairs(split.x_test, split.y_test),
                    loss="next_token" if split.y_train.dim() == 2 else "classification",
                    n_classes=split.n_classes)
