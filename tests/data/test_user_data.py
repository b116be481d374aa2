"""User data sets through `package.module:factory`, each refusal in one line; the zoo's Split as DataSets."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from paraloom.config.errors import UserError
from paraloom.config.rules import is_factory
from paraloom.data import (
    DataSets,
    ShardedBatchSampler,
    Split,
    TensorPairs,
    collate,
    load_user_data,
    make_synthetic,
    split_datasets,
)

HERE = __name__  # pytest imports this file as a top-level module: `test_user_data:make_data` names it


class Squares(Dataset):
    """A user's own map-style data set: (i, i*i mod classes)."""

    def __init__(self, size: int, classes: int = 3) -> None:
        self.size, self.classes = size, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i)]), i * i % self.classes


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def make_data(size: int = 8, *, classes: int = 3) -> DataSets:
    return DataSets(Squares(size, classes), Squares(size // 2, classes), n_classes=classes)


def make_pair(size: int = 4):
    return Squares(size), Squares(2)


def make_triple():
    return Squares(4), Squares(2), "model"


def make_fails(size: int = 4):
    raise ValueError(f"no file for size {size}")


def make_nothing():
    return 42


def make_stream():
    return Stream(), Squares(2)


def make_bad_loss():
    return Squares(4), Squares(2), "regression"


def make_empty():
    return DataSets(Squares(0), Squares(2))


NOT_CALLABLE = 3


def test_factory_shape():
    assert is_factory("pkg.mod:make") and is_factory("mod:make") and is_factory("a.b:C.build")
    for name in ("digits", "pkg.mod:", ":make", "pkg..mod:make", "pkg.mod:make:x", "my-pkg:make", "a.b:1c"):
        assert not is_factory(name), name


def test_a_factory_in_the_test_module_loads_with_its_options():
    data = load_user_data(f"{HERE}:make_data", {"size": 10, "classes": 4})
    assert isinstance(data, DataSets) and len(data.train) == 10 and len(data.eval) == 5
    assert data.loss == "classification" and data.n_classes == 4
    assert data.train[3][1] == 9 % 4
    pair = load_user_data(f"{HERE}:make_pair", {})
    assert (len(pair.train), pair.loss, pair.n_classes) == (4, "classification", None)
    assert load_user_data(f"{HERE}:make_triple", {}).loss == "model"


@pytest.mark.parametrize(("target", "options", "message"), [
    ("digitz", {}, r"data.name='digitz' must look like package.module:factory"),
    ("no_such_pkg_plm.data:make", {}, r"cannot import 'no_such_pkg_plm.data' \(.*\); install it or add "
                                      r"its folder to PYTHONPATH"),
    (f"{HERE}:make_missing", {}, r"has no attribute 'make_missing'"),
    (f"{HERE}:NOT_CALLABLE", {}, r"'NOT_CALLABLE' is not callable \(type int\)"),
    (f"{HERE}:make_data", {"size": 4, "colour": 1, "shape": 2},
     r"the factory takes no option 'colour', 'shape'; it takes: classes, size"),
    (f"{HERE}:Squares", {"classes": 2}, r"cannot be called with these options \(missing a required"),
    (f"{HERE}:make_fails", {"size": 5}, r"^data.name='[\w.]+:make_fails': the factory raised ValueError: "
                                        r"no file for size 5$"),
    (f"{HERE}:make_nothing", {}, r"the factory returned type int; return DataSets\(train, eval, loss\)"),
    (f"{HERE}:make_stream", {}, r"the training set is an IterableDataset; give a map-style Dataset"),
    (f"{HERE}:make_bad_loss", {}, r"loss 'regression' is not known; choose one of: classification, "
                                  r"next_token, model"),
    (f"{HERE}:make_empty", {}, r"the training set is empty"),
])
def test_refusals_are_one_line_user_errors(target, options, message):
    with pytest.raises(UserError, match=message) as caught:
        load_user_data(target, options)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"data.name={target!r}")


def test_a_module_that_fails_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "plm_broken_data.py").write_text("raise RuntimeError('needs the raw files')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="importing 'plm_broken_data' raised RuntimeError: needs the raw"):
        load_user_data("plm_broken_data:make", {})


def test_datasets_refuse_what_is_not_map_style():
    with pytest.raises(UserError, match=r"evaluation set \(type int\) is not a map-style Dataset"):
        DataSets(Squares(2), 7)
    with pytest.raises(UserError, match="not a map-style Dataset"):
        DataSets(Dataset(), Squares(2))  # torch's base class: no __getitem__ of its own
    with pytest.raises(UserError, match="n_classes=0"):
        DataSets(Squares(2), Squares(2), n_classes=0)
    with pytest.raises(UserError, match="choose one of: classification, next_token, model"):
        DataSets(Squares(2), Squares(2), loss="mse")


def _split(next_token: bool) -> Split:
    if next_token:
        x = torch.randint(0, 256, (30, 8))
        return Split(x[:20], x[:20].roll(-1, 1), x[20:], x[20:].roll(-1, 1), n_classes=256)
    return make_synthetic(n_samples=50, n_features=6, n_classes=3)


@pytest.mark.parametrize("next_token", [False, True])
def test_split_datasets_round_trip(next_token):
    split = _split(next_token)
    data = split_datasets(split)
    assert data.loss == ("next_token" if next_token else "classification")
    assert data.n_classes == split.n_classes
    assert len(data.train) == len(split.x_train) and len(data.eval) == len(split.x_test)
    x, y = data.train[5]
    assert torch.equal(x, split.x_train[5]) and torch.equal(y, split.y_train[5])
    x, y = collate(data.eval.__getitems__([2, 0, 1]))
    assert torch.equal(x, split.x_test[[2, 0, 1]]) and torch.equal(y, split.y_test[[2, 0, 1]])


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 3), (2, 3)])
def test_a_dataloader_with_the_sampler_and_collate_gives_direct_indexing(rank, world):
    split = _split(False)
    data = split_datasets(split)
    sampler = ShardedBatchSampler(data.train, 16, rank=rank, world=world, seed=4)
    sampler.set_epoch(1)
    gathered = []  # the fetcher hands collate the batch __getitems__ gathered, not a list of samples

    def spy(batch):
        gathered.append(isinstance(batch, tuple) and batch[0].dim() == 2)
        return collate(batch)

    got = list(DataLoader(data.train, batch_sampler=sampler, collate_fn=spy))
    assert gathered == [True] * 3
    expected = list(sampler.batches())
    assert len(got) == len(expected) == 3
    for (x, y), batch in zip(got, expected, strict=True):
        assert torch.equal(x, split.x_train[batch.indices]) and torch.equal(y, split.y_train[batch.indices])


def test_collate_falls_back_to_default_collate():
    samples = [Squares(5)[i] for i in (1, 2)]
    x, y = collate(samples)
    assert torch.equal(x, torch.tensor([[1.0], [2.0]])) and torch.equal(y, torch.tensor([1, 1]))
    pairs = TensorPairs(torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="x has 3 samples but y has 2"):
        TensorPairs(pairs.x, pairs.y[:2])
    x, y = collate([pairs[0], pairs[2]])  # items one by one, stacked as torch would
    assert torch.equal(x, pairs.x[[0, 2]]) and torch.equal(y, pairs.y[[0, 2]])
