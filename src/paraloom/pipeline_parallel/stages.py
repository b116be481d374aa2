"""A pipeline's stages as a whole: bounds balanced by measured time, the whole model's state, bubbles.

What a training run needs of its stages beyond one step: stage bounds that every rank agrees on
(rank 0 profiles, every rank takes its bounds), the whole model's state dict gathered from the
stages' (piece i of stage s is piece lo_s + i of the model), and the measured bubble.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.p2p import recv_blocking, send_blocking
from paraloom.pipeline_parallel.partition import Bounds, balance_by_params, balance_by_time
from paraloom.pipeline_parallel.schedules import bubble_fraction


def profile_pieces(pieces: list[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Forward plus backward seconds of each piece on `sample` (median of `repeats`)."""
    costs: list[list[float]] = [[] for _ in pieces]
    for _ in range(repeats):
        h = sample
        for i, piece in enumerate(pieces):
            x = h.detach().requires_grad_(h.is_floating_point())
            began = time.perf_counter()
            out = piece(x)
            out.backward(torch.ones_like(out))
            costs[i].append(time.perf_counter() - began)
            h = out.detach()
    for piece in pieces:
        piece.zero_grad(set_to_none=True)
    return [statistics.median(c) for c in costs]


def balance(pieces: list[nn.Module], pp: int, *, by: str, sample: torch.Tensor) -> Bounds:
    """Stage bounds by "params", or by "time" as rank 0 measures it on `sample` (collective then)."""
    if by == "params" or pp == 1:
        return balance_by_params(pieces, pp)
    bounds = torch.zeros(pp, 2, dtype=torch.int64)
    if dist.get_rank() == 0:
        bounds[:] = torch.tensor(balance_by_time(profile_pieces(pieces, sample), pp))
    dist.broadcast(bounds, src=0)
    return [tuple(b) for b in bounds.tolist()]


@torch.no_grad()
def gather_stages(stage_state: dict[str, torch.Tensor], bounds: Bounds, stage: int | list[int],
                  shapes: dict[str, tuple[torch.Size, torch.dtype]], *, sender: bool,
                  source_of: list[int], names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on global rank 0 (collective over rank 0 and the senders).

    `stage_state`: this stage's whole (unsplit) state, its pieces counted from 0; `shapes`: the
    model's keys in order, with shapes and dtypes; `sender`: whether this rank sends its stage
    (one per stage, `source_of[stage]` its global rank). Tensors go point-to-point in key order.
    `stage` may list the virtual stages of an interleaved schedule's chunks, `stage_state` then
    keyed by chunk first ("1.0.weight": chunk 1, its piece 0). `names`: each piece's name in the
    model (`partition.piece_names`), to key the result as the model does ("3.weight" ->
    "blocks.1.weight"); without it, keys count pieces.
    """
    chunked = not isinstance(stage, int)
    stages = list(stage) if chunked else [stage]
    mine = {}
    for key, value in stage_state.items():
        chunk, key = key.split(".", 1) if chunked else ("0", key)
        head, _, rest = key.partition(".")
        mine[f"{int(head) + bounds[stages[int(chunk)]][0]}.{rest}"] = value

    def stage_of(key: str) -> int:
        piece = int(key.partition(".")[0])
        return next(s for s, (lo, hi) in enumerate(bounds) if lo <= piece < hi)

    device = next(iter(stage_state.values())).device
    if dist.get_rank() == 0:
        out = {}
        for key, (shape, dtype) in shapes.items():
            if stage_of(key) in stages:
                out[key] = mine[key]
            else:
                out[key] = torch.empty(shape, dtype=dtype, device=device)
                recv_blocking(out[key], source_of[stage_of(key)])
        return out if names is None else {_renamed(key, names): value for key, value in out.items()}
    if sender:
        for key in shapes:
            if stage_of(key) in stages:
                send_blocking(mine[key].contiguous(), 0)
    return None


def _renamed(key: str, names: list[str]) -> str:
    index, _, rest = key.partition(".")
    prefix = names[int(index)]
    return f"{prefix}.{rest}" if prefix else rest


def bubbles(per_rank: torch.Tensor, pp: int, m: int, v: int = 1,
            per_step: torch.Tensor | None = None) -> dict[str, object]:
    """Bubble figures from every rank's (median step, busy, schedule[, steady-state wait[, pipeline
    stage]]) seconds, one row per rank; with `per_step` ([rank, (busy, schedule, steady-state wait),
    step]) each share is instead the median over steps of that step's share.

    A share is a small difference of two long times (about 0.1 of a step): read from medians taken
    step by step apart, a step's jitter in the one does not cancel the same step's in the other, and
    the share moves several times as much as either median; read within each step, it does.

    The fill and drain are read against the schedule's makespan: the first stage's schedule time,
    since its first forward starts a step and its last backward ends it. A later stage starts its
    step by waiting for that forward, so its own schedule time also holds whatever the first stage
    does between steps beyond what the later stage does (a longer optimizer step, the next batch),
    which no schedule counts. Rows without a stage column are all taken for first stages, and the
    last row for the last stage."""
    if per_step is None:  # one "step": the medians themselves
        per_step = per_rank[:, 1:4].unsqueeze(-1)
        if per_rank.shape[1] < 4:
            per_step = torch.cat([per_step, torch.zeros_like(per_step[:, :1])], dim=1)
    busy, schedule, steady = per_step[:, 0], per_step[:, 1], per_step[:, 2]
    stage = per_rank[:, 4] if per_rank.shape[1] > 4 else None
    first = stage == 0 if stage is not None else torch.ones(len(per_rank), dtype=torch.bool)
    last = stage == stage.max() if stage is not None else torch.arange(len(per_rank)) == len(per_rank) - 1
    ran = bool(schedule.max() > 0)
    makespan = schedule[first].amax(0) if ran else schedule.amax(0)  # per step
    longest = schedule.amax(0).clamp_min(1e-12)
    neck = int(_median(busy).argmax())  # the bottleneck stage: the most compute
    fill_drain = _median(1 - (busy + steady) / makespan.clamp_min(1e-12))
    own = torch.where(schedule > 0, 1 - busy / schedule.clamp_min(1e-12), torch.zeros_like(busy))
    return {
        "step_seconds": float(per_rank[:, 0].max()),  # a step is done when the slowest rank is
        "step_seconds_per_rank": per_rank[:, 0].tolist(),
        "schedule_seconds_per_rank": _median(schedule).tolist(),  # the pipeline schedule alone
        "makespan_seconds": float(_median(makespan)),
        # the share of the schedule's time a rank did not compute (the optimizer step excluded)
        "bubble_per_rank": _median(own).tolist(),
        # the whole pipeline's: idle share of all ranks' time over the slowest rank's schedule time
        "bubble": float(_median(1 - busy.mean(0) / longest)) if ran else 0.0,
        # the bottleneck stage's, without the others' load imbalance: fill, drain and steady-state waits
        "bubble_bottleneck": float(_median(1 - busy[neck] / longest)) if ran else 0.0,
        # ... its waits where the ideal schedule has none (uneven compute, the runtime's own work)
        "steady_wait_bottleneck": float(_median(steady[neck] / longest)) if ran else 0.0,
        # the rest within the makespan: the fill and drain that (p-1)/(v m+p-1) describes
        "bubble_fill_drain": float(fill_drain[neck]) if ran else 0.0,
        # every rank's: a first stage that computes more than the rest loses fill and drain as they
        # run ahead of it; a busier last stage's stays near the theory's (`schedules.fill_drain_shares`)
        "bubble_fill_drain_per_rank": fill_drain.tolist() if ran else [],
        # the last stage's (the mean over its ranks): the ideal run idles it only before its first
        # action and after its last (`schedules.idle_before`), so a neighbour's jitter in mid-schedule
        # cannot move a wait into or out of it, as it does the first stage's between its backwards
        "bubble_fill_drain_last_stage": float(fill_drain[last].mean()) if ran else 0.0,
        "bubble_theory": bubble_fraction(pp, m, v) if pp > 1 else 0.0,
    }


def _median(t: torch.Tensor) -> torch.Tensor:
    """The median over the last dimension (the mean of the two middle values of an even count)."""
    return torch.quantile(t.double(), 0.5, dim=-1)
