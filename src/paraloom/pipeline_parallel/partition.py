"""Contiguous partitions of a sequence of pieces into pipeline stages, minimising the largest stage's cost."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from paraloom.errors import UserError

Bounds = list[tuple[int, int]]  # [(start, end), ...]: stage s holds pieces[start:end]


def balance_by_time(costs: Sequence[float], p: int) -> Bounds:
    """Split `costs` into `p` non-empty contiguous stages whose largest sum is as small as it can be.

    Exact dynamic programme, O(p n^2): best[k][j] is the smallest possible largest stage when the
    first j pieces form k stages. Among optimal splits the earliest cut points win (deterministic).
    """
    n = len(costs)
    if not isinstance(p, int) or p < 1:
        raise UserError(f"pipeline stages p={p!r} must be a positive integer")
    if p > n:
        raise UserError(f"cannot split {n} pieces into {p} non-empty pipeline stages; choose p <= {n}")
    if any(c < 0 for c in costs):
        raise UserError(f"piece costs must not be negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):  # leave at least one piece for each later stage
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(p, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


def param_counts(pieces: Iterable[nn.Module]) -> list[int]:
    return [sum(t.numel() for t in piece.parameters()) for piece in pieces]


def balance_by_params(module_list: Iterable[nn.Module], p: int) -> Bounds:
    """Split pieces (an `nn.Sequential` or a list of modules) into `p` stages balancing parameter counts."""
    return balance_by_time(param_counts(module_list), p)


def stage_module(model: nn.Sequential | Sequence[nn.Module], bounds: Bounds, stage: int) -> nn.Sequential:
    """Stage `stage`'s pieces as one `nn.Sequential` (modules are shared with `model`, not copied)."""
    if not 0 <= stage < len(bounds):
        raise UserError(f"stage {stage} outside a pipeline of {len(bounds)} stages")
    start, end = bounds[stage]
    return nn.Sequential(*list(model)[start:end])
