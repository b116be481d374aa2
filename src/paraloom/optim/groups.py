"""The optimizer's parameter groups: parameters `optim.no_decay` names train without weight decay."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn

from paraloom.config.errors import UserError

VECTORS = "1d"  # every parameter of fewer than two dimensions: biases, norm scales (nanoGPT's rule)
_MARK = "_paraloom_no_decay"  # set on a parameter the rule exempts; it travels with the object


def no_decay_patterns(text: str | None) -> list[str]:
    """`optim.no_decay`'s comma-separated entries: name patterns (`*.bias`, `*norm*`) or `1d`."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def mark_no_decay(model: nn.Module, text: str | None, *, model_name: str = "the model") -> int:
    """Mark the parameters of `model` that `text` exempts from weight decay (names as
    `named_parameters()` gives them, matched whole with `*` and `?`); how many were marked.

    Marks go on the parameter objects, so they hold wherever the parameter goes (a pipeline stage,
    a bucket); call again after module surgery that replaces parameters (tensor parallelism).
    A pattern that matches no parameter is a UserError: a misspelt name would otherwise silently
    decay what the user meant to exempt.
    """
    patterns = no_decay_patterns(text)
    if not patterns:
        return 0
    hits = dict.fromkeys(patterns, 0)
    named = list(model.named_parameters())
    for name, p in named:
        matched = [pattern for pattern in patterns
                   if (p.dim() < 2 if pattern == VECTORS else fnmatchcase(name, pattern))]
        for pattern in matched:
            hits[pattern] += 1
        setattr(p, _MARK, bool(matched))
    missing = [pattern for pattern, count in hits.items() if count == 0]
    if missing:
        examples = ", ".join(name for name, _ in named[:4])
        raise UserError(f"optim.no_decay {missing[0]!r} matches no parameter of {model_name} "
                        f"(its parameters are named like {examples}); use `*` for any part of a name, "
                        f"or {VECTORS} for every bias and norm scale")
    return sum(getattr(p, _MARK) for _, p in named)


def decay_groups(params: Iterable[nn.Parameter]) -> list:
    """`params` as the optimizer takes them: one list where nothing is marked, else a group that
    decays and one (`weight_decay` 0) that does not, each in the order the parameters came."""
    params = list(params)
    exempt = [p for p in params if getattr(p, _MARK, False)]
    if not exempt:
        return params
    decayed = [p for p in params if not getattr(p, _MARK, False)]
    return ([{"params": decayed}] if decayed else []) + [{"params": exempt, "weight_decay": 0.0}]
