"""Byte-level text corpus: deterministic, split by file, windows shifted by one; the unigram bar is right."""

import math
import zlib

import pytest
import torch

from paraloom.config.errors import UserError
from paraloom.data.split import Split
from paraloom.data.text import VOCAB, load_text, stdlib_files, unigram_loss, windows

SEQ_LEN, TEXT_BYTES = 64, 20_000


@pytest.fixture(scope="module")
def corpus() -> Split:
    return load_text(seq_len=SEQ_LEN, text_bytes=TEXT_BYTES)


def test_load_is_deterministic(corpus):
    again = load_text(seq_len=SEQ_LEN, text_bytes=TEXT_BYTES)
    for a, b in zip((corpus.x_train, corpus.y_train, corpus.x_test, corpus.y_test),
                    (again.x_train, again.y_train, again.x_test, again.y_test), strict=True):
        assert torch.equal(a, b)


def test_shapes_and_sizes_follow_text_bytes(corpus):
    assert corpus.input_shape == (SEQ_LEN,) and corpus.n_classes == VOCAB == 256
    assert corpus.x_train.dtype == torch.long and 0 <= corpus.x_train.min() and corpus.x_train.max() < VOCAB
    assert TEXT_BYTES - 1 - SEQ_LEN < corpus.x_train.numel() <= TEXT_BYTES - 1
    test_bytes = int(TEXT_BYTES * 0.1)  # default test_fraction
    assert test_bytes - 1 - SEQ_LEN < corpus.x_test.numel() <= test_bytes - 1


def test_targets_are_inputs_shifted_by_one(corpus):
    for x, y in ((corpus.x_train, corpus.y_train), (corpus.x_test, corpus.y_test)):
        assert x.shape == y.shape
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(y[:-1, -1], x[1:, 0])  # consecutive windows continue the text


def test_windows_cover_the_text_in_order():
    x, y = windows(bytes(range(10)), 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def _fake_library(root, n_files: int = 120, size: int = 300) -> dict[str, int]:
    """Files named f<i>.py, each `size` copies of its own byte value; returns name -> byte."""
    marks = {}
    for i in range(n_files):
        name = f"pkg{i % 3}/f{i}.py"
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(bytes([i + 1]) * size)
        marks[name] = i + 1
    return marks


def test_train_and_validation_come_from_disjoint_files(tmp_path):
    marks = _fake_library(tmp_path)
    split = load_text(seq_len=16, text_bytes=10_000, test_fraction=0.2, root=tmp_path)
    train, test = set(split.x_train.unique().tolist()), set(split.x_test.unique().tolist())
    assert train and test and not train & test
    on_test_side = {mark for name, mark in marks.items() if zlib.crc32(name.encode()) % 1000 < 200}
    assert test <= on_test_side and not train & on_test_side  # each file's side is fixed by its hash


def test_stdlib_files_skip_site_packages(tmp_path):
    _fake_library(tmp_path, n_files=4)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_bytes(b"x = 1\n")
    (tmp_path / "pkg" / "dist-packages").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_bytes(b"y = 2\n")
    (tmp_path / "pkg" / "dist-packages" / "vendored.py").write_bytes(b"z = 3\n")
    found = stdlib_files(tmp_path)
    assert len(found) == 5 and found == sorted(found)
    assert all("site-packages" not in path.parts and "dist-packages" not in path.parts for _, path in found)
    # the order key is the crc32 of the path relative to the library, as the split's hash is
    keys = {key: str(path.relative_to(tmp_path)) for key, path in found}
    assert keys[zlib.crc32(b"pkg/mod.py")] == "pkg/mod.py"


def test_too_little_text_for_one_window_says_what_to_do(tmp_path):
    with pytest.raises(UserError, match="raise data.text_bytes"):
        load_text(seq_len=128, text_bytes=50)
    with pytest.raises(UserError, match="raise data.text_bytes"):
        load_text(seq_len=16, text_bytes=10_000, root=tmp_path)  # an empty library
    with pytest.raises(UserError, match="positive"):
        load_text(seq_len=0)


def test_unigram_loss_is_between_zero_and_uniform(corpus):
    loss = unigram_loss(corpus)
    assert 0.0 < loss < math.log(VOCAB)


def test_unigram_loss_matches_a_hand_computation():
    split = Split(torch.zeros(1, 3), torch.tensor([[0, 0, 1]]), torch.zeros(1, 3), torch.tensor([[0, 1, 2]]),
                  n_classes=VOCAB)
    total = 3 + 2 + 1 * 254  # add-one smoothed counts: byte 0 seen twice, byte 1 once, 254 others never
    expected = -(math.log(3 / total) + math.log(2 / total) + math.log(1 / total)) / 3
    assert unigram_loss(split) == pytest.approx(expected, rel=1e-12)
