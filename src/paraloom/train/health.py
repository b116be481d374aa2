"""Online straggler attribution: every `run.health_every` steps the ranks swap their own timings,
and a rank that lags its peers in 3 checks in a row is named, with the term that makes it slow.

Each rank sends the medians of its last interval's steps: compute (forward and backward, waits
excluded), input (waiting for the batch) and communication (blocked in collectives or on the
parameter servers), and its step. Peers are the ranks doing the same work: every data-parallel
or parameter-server worker; a pipeline stage's ranks in every replica. A rank lags when its own
time (compute + input) exceeds its peers' median by more than `THRESHOLD` of it (and by `FLOOR`
of their median step); the term is whichever of the two exceeds more. Where no rank lags in its
own time, an asynchronous parameter-server worker whose communication alone exceeds its peers'
so is named for its link (in a synchronous collective, waits say who is late, not whose link is
slow). Synchronous strategies
launch one small all-gather a step before each check and wait for it at the check (it completes
behind that step's work); asynchronous parameter-server workers read it only once it has
completed, never waiting for it.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

THRESHOLD = 0.5  # of the peers' median of the same time (compute + input, or communication)
FLOOR = 0.05  # and at least this share of their median step: noise on tiny terms is no straggler
LINK_FLOOR = 0.2  # a link's excess: at least this share of the step
CHECKS = 3  # consecutive checks a rank must lag in
FIELDS = ("key", "compute", "data", "communication", "step")
NAMES = {"compute": "compute", "data": "input", "communication": "link"}


def lagging(rows: list[dict[str, float]], *, links: bool = True) -> dict[int, tuple[str, float]]:
    """rank -> (term, lag as a share of its peers' median step) for every rank lagging in this check;
    `links=False`: none for its link (see `Health`)."""
    own, link = {}, {}
    for r, row in enumerate(rows):
        peers = [p for p, other in enumerate(rows) if other["key"] == row["key"] and p != r]
        if not peers:
            continue
        median = {f: statistics.median(rows[p][f] for p in peers) for f in FIELDS[1:]}
        excess = {term: row[term] - median[term] for term in ("compute", "data", "communication")}
        floor = FLOOR * median["step"]
        if excess["compute"] + excess["data"] > max(THRESHOLD * (median["compute"] + median["data"]), floor):
            term = max(("compute", "data"), key=excess.get)
            own[r] = (NAMES[term], (excess["compute"] + excess["data"]) / median["step"])
        elif links and excess["communication"] > max(THRESHOLD * median["communication"],
                                                     LINK_FLOOR * median["step"]):
            link[r] = (NAMES["communication"], excess["communication"] / median["step"])
    return own or link  # peers that wait for a slow rank communicate longer: not their link's fault


class Health:
    """One rank's side of the exchange; every rank judges alike, rank 0 speaks."""

    def __init__(self, every: int, group: dist.ProcessGroup | None, *, key: int, lockstep: bool,
                 speaks: bool, last_step: int) -> None:
        self.every, self.group, self.key, self.lockstep, self.speaks = every, group, key, lockstep, speaks
        self.last_step = last_step  # no exchange is launched for a check past the run's end
        self.rows: list[tuple[float, float, float, float]] = []
        self.pending: list[tuple[int, Any, list[torch.Tensor]]] = []
        self.streak: dict[int, tuple[str, int]] = {}
        self.named: list[dict[str, Any]] = []
        self.checks = 0  # exchanges judged
        self.seconds = 0.0  # spent exchanging and judging: what the checks cost the run

    def record(self, step: int, terms: dict[str, float], step_seconds: float) -> list[dict[str, Any]]:
        """One step's timings. The step before every `every`-th launches the exchange (collective),
        which completes behind the next step's work; the `every`-th judges it. Returns who is newly
        named."""
        if not self.every:
            return []
        self.rows.append((terms.get("compute", 0.0), terms.get("data", 0.0), terms.get("communication", 0.0),
                          step_seconds))
        launch = (step + 1) % self.every == 0 and step < self.last_step
        judge = step % self.every == 0
        if not (launch or judge):
            return []
        began = time.perf_counter()
        if launch:
            self.launch(step + 1)
        named = self.settle(wait=self.lockstep) if judge else []
        self.seconds += time.perf_counter() - began
        return named

    def launch(self, step: int) -> None:
        """Send this rank's medians since the last exchange, to be judged at `step`."""
        medians = [statistics.median(column) for column in zip(*self.rows, strict=True)]
        self.rows.clear()
        mine = torch.tensor([float(self.key), *medians], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(every, mine, group=self.group, async_op=True)
        self.pending.append((step, work, every))

    def settle(self, *, wait: bool) -> list[dict[str, Any]]:
        """Judge the exchanges that have completed, in order (all of them with `wait`: at the end,
        where every rank has launched as many)."""
        named = []
        while self.pending and (wait or self.pending[0][1].is_completed()):
            at, work, gathered = self.pending.pop(0)
            work.wait()
            named += self.judge(at, [dict(zip(FIELDS, row.tolist(), strict=True)) for row in gathered])
        return named

    def judge(self, step: int, rows: list[dict[str, float]]) -> list[dict[str, Any]]:
        self.checks += 1
        # in a synchronous collective a rank waits for whoever is late, so waits differ by the others'
        # host work (rank 0 draws the progress bar) with no link slow: links are named between workers
        # that wait for no one but their servers (ASP, SSP)
        lag = lagging(rows, links=not self.lockstep)
        before = self.streak
        self.streak = {r: (term, before[r][1] + 1 if r in before and before[r][0] == term else 1)
                       for r, (term, _) in lag.items()}
        named = []
        for r, (term, count) in self.streak.items():
            if count == CHECKS:
                entry = {"rank": r, "term": term, "step": step, "lag": round(lag[r][1], 3)}
                named.append(entry)
                if self.speaks:
                    print(f"paraloom: warning: rank {r} is a straggler at step {step}: its {term} makes its "
                          f"steps {lag[r][1]:.0%} longer than its peers' for {CHECKS} checks in a row",
                          file=sys.stderr)
        self.named += named
        return named
