"""Contiguous partitions of a sequence of pieces into pipeline stages, minimising the largest stage's cost."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from paraloom.config.errors import UserError

Bounds = list[tuple[int, int]]  # [(start, end), ...]: stage s holds pieces[start:end]


def balance_by_time(costs: Sequence[float], p: int) -> Bounds:
    """Split `costs` into `p` non-empty contiguous stages whose largest sum is as small as it can be.

    Exact dynamic programme, O(p n^2): `best[k][j]` is the smallest possible largest stage when the
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


def model_pieces(model: nn.Module, *, whole: bool = False) -> list[nn.Module]:
    """The pieces a model runs in sequence: an `nn.Sequential`'s children, or what its
    `pipeline_pieces()` lists (each piece's output is the next one's input; together they hold
    every parameter of the model). `whole`: a model that lists none is one piece, for one stage
    (tensor parallelism alone splits layers by its plan, not the model into a sequence)."""
    if isinstance(model, nn.Sequential):
        return list(model)
    listed = getattr(model, "pipeline_pieces", None)
    if not callable(listed) and whole:
        return [model]
    if not callable(listed):
        raise UserError(f"{type(model).__name__} is neither an nn.Sequential nor lists its pieces: pipeline "
                        "and layer parallelism need one of them (define pipeline_pieces() returning the "
                        "modules forward runs in order)")
    pieces = list(listed())
    held = {id(p) for piece in pieces for p in piece.parameters()}
    missing = [name for name, p in model.named_parameters() if id(p) not in held]
    if not pieces or missing:
        raise UserError(f"{type(model).__name__}.pipeline_pieces() must list modules holding every "
                        f"parameter; it leaves out {', '.join(missing[:4]) or 'everything'}")
    return pieces


def piece_names(model: nn.Module, pieces: Sequence[nn.Module]) -> list[str]:
    """Each piece's name in `model` (its state-dict prefix); for an nn.Sequential, "0", "1", ..."""
    names = {id(module): name for name, module in model.named_modules()}
    return [names.get(id(piece), str(i)) for i, piece in enumerate(pieces)]
