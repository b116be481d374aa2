"""A parameter-server checkpoint onto another number of servers or workers: the saved slices, joined in
flat order and cut again by the new layout.

A checkpoint is a consistent cut at step c: every slice holds exactly c pushes of every worker. The
element-wise state of a slice -- its parameters, BSP's partial gradient sum and every optimizer
state tensor shaped as the slice (Adam's exp_avg and exp_avg_sq, momentum buffers) -- is joined
over the saved slices and cut at the new bounds. The rest is one slice's (an optimizer's `step`
and hyper-parameters, the version, the counters, the staleness histograms): the new slice takes
the saved slice that holds its first element. Clocks restart at the cut: every server's clock of
every worker is c, and so is every worker's own.
"""

from __future__ import annotations

import bisect
import copy
import itertools
from typing import Any

import torch

from paraloom.config.errors import UserError

COUNTERS = ("version", "summed", "arrived", "pushes_applied", "dropped", "refused")


def saved_slices(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every saved slice's state in the flat vector's order, from the saved servers' parts (in rank
    order, each its slices in slot order: slice_layout's order)."""
    return [piece for part in parts for piece in part["slices"]]


def recut(saved: list[dict[str, Any]], bounds: list[tuple[int, int]], *, n_params: int, workers: list[int],
          clock: int, updates_scale: tuple[int, int] = (1, 1)) -> list[dict[str, Any]]:
    """The `ParameterServer.state_dict()` of each new slice [lo, hi) of `bounds` (of a model of
    `n_params` trained parameters), from the `saved` slices (saved_slices), with every clock at `clock`
    for each of `workers`. `updates_scale` (new, old): the optimizer's schedule counts `updates` per
    step (ASP, SSP: one per worker), so a new number of workers scales the count it reads."""
    sizes = [piece["param"].numel() for piece in saved]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    if sum(sizes) != n_params:
        raise UserError(f"the checkpoint's servers hold {sum(sizes)} parameters; this model has {n_params}: "
                        "resume with the model that saved it")
    whole = {"param": torch.cat([piece["param"] for piece in saved]),
             "grad": torch.cat([piece["grad"] for piece in saved])}
    whole.update({f"optimizer.{name}": value for name, value in _elementwise(saved, sizes).items()})
    new, old = updates_scale
    out = []
    for lo, hi in bounds:
        first = saved[bisect.bisect_right(starts, lo) - 1]  # the saved slice holding element lo
        saved_optimizer = first["optimizer"]
        states = {key: {name: whole[f"optimizer.{name}"][lo:hi].clone() if f"optimizer.{name}" in whole
                        else copy.deepcopy(value) for name, value in state.items()}
                  for key, state in saved_optimizer["state"].items()}
        groups = copy.deepcopy(saved_optimizer["param_groups"])
        for group in groups:
            if "updates" in group:
                group["updates"] = group["updates"] * new // old
        received = {int(w): int(n) for w, n in first["received"].items()}
        out.append({"param": whole["param"][lo:hi].clone(), "grad": whole["grad"][lo:hi].clone(),
                    "optimizer": {**saved_optimizer, "state": states, "param_groups": groups},
                    "clocks": dict.fromkeys(workers, clock), **{name: first[name] for name in COUNTERS},
                    "received": {w: received.get(w, 0) for w in workers},
                    "staleness": dict(first["staleness"]), "read_staleness": dict(first["read_staleness"])})
    return out


def _elementwise(saved: list[dict[str, Any]], sizes: list[int]) -> dict[str, torch.Tensor]:
    """Each optimizer state tensor shaped as its slice, joined over the saved slices (a slice's
    optimizer holds one parameter: state key 0)."""
    states = [next(iter(piece["optimizer"]["state"].values()), {}) for piece in saved]
    names = {name for state in states for name, value in state.items()
             if torch.is_tensor(value) and value.dim() > 0}
    joined = {}
    for name in sorted(names):
        values = [state.get(name) for state in states]
        if any(v is None or v.numel() != size for v, size in zip(values, sizes, strict=True)):
            raise UserError(f"the saved servers' optimizer state {name!r} is not one value per parameter of "
                            "every slice: resume on the number of servers that saved it")
        joined[name] = torch.cat([v.reshape(-1) for v in values])
    return joined
