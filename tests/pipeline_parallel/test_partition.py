"""Contiguous stage partitions: exact min-max balance, non-empty stages, errors that say what to do."""

import itertools

import pytest
from torch import nn

from paraloom.config.errors import UserError
from paraloom.models.gpt import GPT
from paraloom.pipeline_parallel.partition import balance_by_params, balance_by_time, stage_module


def brute_force(costs, p):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))
        best = worst if best is None else min(best, worst)
    return best


def check(bounds, n, p):
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(p - 1))


@pytest.mark.parametrize("costs, p, expected", [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
    ([1, 2, 3, 4, 5], 3, [(0, 3), (3, 4), (4, 5)]),
    ([3, 3, 3], 3, [(0, 1), (1, 2), (2, 3)]),
    ([0, 0, 10], 2, [(0, 1), (1, 3)]),
    ([7], 1, [(0, 1)]),
])
def test_literal_partitions(costs, p, expected):
    assert balance_by_time(costs, p) == expected


@pytest.mark.parametrize("seed", range(20))
def test_optimal_against_brute_force(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    costs = [rng.choice([0, rng.randint(1, 20), rng.random() * 10]) for _ in range(n)]
    p = rng.randint(1, n)
    bounds = balance_by_time(costs, p)
    check(bounds, n, p)
    assert max(sum(costs[a:b]) for a, b in bounds) == pytest.approx(brute_force(costs, p))


def test_too_many_stages():
    with pytest.raises(UserError, match="choose p <= 3"):
        balance_by_time([1, 2, 3], 4)
    with pytest.raises(UserError, match="positive integer"):
        balance_by_time([1, 2, 3], 0)
    with pytest.raises(UserError, match="must not be negative"):
        balance_by_time([1, -2, 3], 2)


def test_balance_gpt_by_params():
    gpt = GPT((16,), 256, n_layers=4, d_model=32, n_heads=4)  # pieces: Embedding, 4 Blocks, Head
    assert balance_by_params(gpt, 2) == [(0, 3), (3, 6)]
    bounds = balance_by_params(gpt, 4)
    assert bounds == [(0, 2), (2, 3), (3, 4), (4, 6)]
    stages = [stage_module(gpt, bounds, s) for s in range(4)]
    assert [len(s) for s in stages] == [2, 1, 1, 2]
    assert stages[0][0] is gpt[0]  # shared, not copied
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in gpt.parameters())


def test_balance_module_list_with_parameterless_pieces():
    pieces = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU()]
    assert balance_by_params(pieces, 2) == [(0, 1), (1, 4)]
    assert balance_by_params(pieces, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
