"""Column, row, vocabulary-parallel embedding and loss equal their unsplit versions, forward and grads."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.config.errors import UserError
from paraloom.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def _column(rank, world):
    torch.manual_seed(0)
    full = nn.Linear(8, 12)
    x = torch.randn(3, 5, 8, requires_grad=True)
    weights = torch.randn(3, 5, 12)
    (full(x) * weights).sum().backward()
    share = slice(rank * 12 // world, (rank + 1) * 12 // world)
    strided = torch.arange(rank, 12, world)
    for rows, gather in ((None, True), (None, False), (strided, False)):
        layer = ColumnParallelLinear.from_linear(full, rows=rows, gather_output=gather)
        index = strided if rows is not None else torch.arange(12)[share]
        x2 = x.detach().clone().requires_grad_()
        y = layer(x2)
        expected = full(x) if gather else full(x)[..., index]
        assert_close(y, expected)
        (y * (weights if gather else weights[..., index])).sum().backward()
        assert_close(x2.grad, x.grad)  # the copy_to_region all-reduce completes the input gradient
        assert_close(layer.weight.grad, full.weight.grad[index])
        assert_close(layer.bias.grad, full.bias.grad[index])
    return True


def _row(rank, world):
    torch.manual_seed(0)
    full = nn.Linear(12, 6)
    x = torch.randn(3, 5, 12, requires_grad=True)
    weights = torch.randn(3, 5, 6)
    y_full = full(x)
    (y_full * weights).sum().backward()
    cols = slice(rank * 12 // world, (rank + 1) * 12 // world)
    for parallel in (True, False):
        layer = RowParallelLinear.from_linear(full, input_is_parallel=parallel)
        x2 = (x.detach()[..., cols] if parallel else x.detach()).clone().requires_grad_()
        y = layer(x2)
        assert_close(y, y_full)
        (y * weights).sum().backward()
        assert_close(x2.grad, x.grad[..., cols] if parallel else x.grad)
        assert_close(layer.weight.grad, full.weight.grad[:, cols])
        assert_close(layer.bias.grad, full.bias.grad)  # bias added once, after the reduce
    return True


def _embedding(rank, world):
    torch.manual_seed(0)
    full = nn.Embedding(16, 4)
    ids = torch.randint(0, 16, (3, 5))
    weights = torch.randn(3, 5, 4)
    (full(ids) * weights).sum().backward()
    layer = VocabParallelEmbedding.from_embedding(full)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    assert (layer.vocab_start, layer.vocab_end) == (rows.start, rows.stop)
    y = layer(ids)
    assert_close(y, full(ids))
    (y * weights).sum().backward()
    assert_close(layer.weight.grad, full.weight.grad[rows])
    return True


def _cross_entropy(rank, world):
    torch.manual_seed(0)
    logits = (30 * torch.randn(4, 6, 16)).requires_grad_()  # large logits: the max must be subtracted
    targets = torch.randint(0, 16, (4, 6))
    share = slice(rank * 16 // world, (rank + 1) * 16 // world)
    for smoothing in (0.0, 0.1):  # label smoothing: one more sum in the same all-reduce
        logits.grad = None
        ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing)
        ref.backward()
        local = logits.detach()[..., share].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, smoothing=smoothing)
        assert_close(loss, ref)
        loss.backward()
        assert_close(local.grad, logits.grad[..., share])
    return True


def _bad_sizes(rank, world):
    with pytest.raises(UserError, match=r"tp=4 does not divide out_features=6; choose tp in \{1, 2, 3, 6\}"):
        ColumnParallelLinear.from_linear(nn.Linear(8, 6))
    with pytest.raises(UserError, match=r"tp=4 does not divide in_features=6"):
        RowParallelLinear.from_linear(nn.Linear(6, 8))
    with pytest.raises(UserError, match=r"tp=4 does not divide vocab_size=10; choose tp in \{1, 2, 5, 10\}"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(10, 4))
    with pytest.raises(UserError, match="padding_idx"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(16, 4, padding_idx=0))
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("check", [_column, _row, _embedding, _cross_entropy], ids=lambda f: f.__name__[1:])
def test_layer_equals_unsplit(check, world):
    assert all(run_workers(check, world))


def test_bad_sizes_raise_user_error():
    assert all(run_workers(_bad_sizes, 4))


def test_one_rank_without_process_group():
    torch.manual_seed(0)
    full, emb = nn.Linear(8, 12), nn.Embedding(16, 4)
    x, ids = torch.randn(2, 8), torch.randint(0, 16, (2, 3))
    assert_close(ColumnParallelLinear.from_linear(full)(x), full(x))
    assert_close(RowParallelLinear.from_linear(full)(x), full(x))
    assert_close(VocabParallelEmbedding.from_embedding(emb)(ids), emb(ids))
    logits, targets = torch.randn(2, 3, 16), torch.randint(0, 16, (2, 3))
    assert_close(vocab_parallel_cross_entropy(logits, targets),
                 F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
