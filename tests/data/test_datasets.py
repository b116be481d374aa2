"""Data sets: digits is real and split reproducibly; synthetic is seeded and learnable in shape."""

import pytest
import torch

from paraloom.config.errors import UserError
from paraloom.data import load_dataset


def test_digits_split_is_fixed_stratified_and_scaled():
    a, b = load_dataset("digits", split_seed=0), load_dataset("digits", split_seed=0)
    assert a.input_shape == (1, 8, 8) and a.n_classes == 10
    assert len(a.y_train) + len(a.y_test) == 1797
    assert 355 <= len(a.y_test) <= 365  # 20%, rounded per class
    assert torch.equal(a.x_test, b.x_test)
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
    assert set(a.y_test.tolist()) == set(range(10))  # stratified: every class is tested
    for label in range(10):  # stratified: each class is split 80/20
        n_test, n_train = (a.y_test == label).sum().item(), (a.y_train == label).sum().item()
        assert abs(n_test / (n_test + n_train) - 0.2) < 0.02
    c = load_dataset("digits", split_seed=1)
    assert not torch.equal(a.x_test, c.x_test)


def test_synthetic_is_seeded():
    a = load_dataset("synthetic", n_samples=100, n_features=5, n_classes=3, split_seed=4)
    b = load_dataset("synthetic", n_samples=100, n_features=5, n_classes=3, split_seed=4)
    assert torch.equal(a.x_train, b.x_train) and a.input_shape == (5,)
    assert len(a.y_train) + len(a.y_test) == 100 and a.y_train.max() < 3


def test_unknown_data_set_lists_choices():
    with pytest.raises(UserError, match="choose one of: digits, synthetic"):
        load_dataset("nope")


def test_digits_matches_scikit_learn_and_splits_disjointly():
    from sklearn.datasets import load_digits as sk_load_digits

    x, _ = sk_load_digits(return_X_y=True)
    a = load_dataset("digits")
    rows = torch.cat([a.x_train, a.x_test]).flatten(1) * 16.0
    ours = sorted(map(tuple, rows.round().int().tolist()))
    assert ours == sorted(map(tuple, x.astype(int).tolist()))  # the same 1,797 images, each once
