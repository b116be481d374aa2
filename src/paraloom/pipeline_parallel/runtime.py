"""PipelineStage: one runtime that runs any schedule's actions for one stage over point-to-point messages.

Per action: F_i takes micro-batch i's input (the first stage's `inputs[i]`, else the activation
received from the previous stage), runs the stage module and sends the output on (the last stage
computes `loss_fn(out, targets[i])` scaled by its micro-batch's share of the batch instead); B_i
back-propagates the gradient received from the next stage (the last stage: its scaled loss) and
sends the input's gradient back. Receives are posted a couple of actions ahead; sends are
asynchronous and waited for at the end of the step, so any deadlock-free schedule runs.

Activation shapes are not configured: a forward message is preceded by a 16-int header (dtype
code, ndim, shape), so micro-batch sizes and sequence lengths may change between steps and even
within one. With `static_shapes=True` only the first step of each micro-batch index sends a
header: later steps reuse the learnt shape, so a receive is posted actions ahead with no header
round trip first (a sender whose shape changes then stops with an error that says so).
Gradients need no header: a stage knows the shape of its own output.
Tags are unique per (micro-batch, boundary, channel): header, activation, gradient, where the
boundary is between virtual stages u and u + 1. `infer` sends one batch forward only
(evaluation), with the same header, on tags of its own.

With `virtual_stages=v` (interleaved 1F1B) a stage holds v model chunks and `module(x, chunk=c)`
runs chunk c (`Chunks`); chunk c of stage s is virtual stage u = c p + s, so the last stage's
chunk c sends on to the first stage's chunk c + 1. Everything keyed by micro-batch is keyed by
(micro-batch, chunk).

With an active `Timeline` a step records "F{i}" / "B{i}" (lane "compute"), "send F{i} to stage {k}"
/ "send B{i} to stage {k}" and "wait F{i}" / "wait B{i}" (lane "p2p"); without one, `is None` checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.p2p import Peers
from paraloom.errors import UserError
from paraloom.pipeline_parallel.run import (
    ACTIVATION_TAG,
    DTYPES,
    HEADER,
    HEADER_TAG,
    INFER_TAG,
    StepRun,
    StepStats,
    header_of,
)
from paraloom.pipeline_parallel.schedules import Action, idle_before, make_schedule, validate
from paraloom.trace.timeline import Timeline


class Chunks(nn.ModuleList):
    """A stage's model chunks under an interleaved schedule: `chunks(x, chunk=c)` runs chunk c."""

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        return self[chunk](x)


def split_microbatches(batch: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """Cut a batch along dim 0 into `n_microbatches` pieces (sizes differ by at most one)."""
    if not 1 <= n_microbatches <= len(batch):
        raise UserError(f"cannot cut a batch of {len(batch)} into {n_microbatches} micro-batches; "
                        f"choose n_microbatches between 1 and {len(batch)}")
    return list(torch.tensor_split(batch, n_microbatches))


class PipelineStage:
    """One pipeline stage: `module` (a slice of the model) as stage `stage` of `n_stages` in `pp_group`.

    `pp_group` ranks are stages in order (group rank = stage; `Topology`'s pp groups are). The last
    stage needs `loss_fn(output, target) -> mean loss of the micro-batch`. `module` may be a
    `DataParallel` engine; pass its `no_sync` to `step`. `history` keeps every step's `StepStats`.
    `timeline` (also settable later) records each step's compute, sends and waits while active.
    """

    def __init__(self, module: nn.Module, *, pp_group: dist.ProcessGroup | None = None,
                 stage: int | None = None, n_stages: int | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 static_shapes: bool = False, timeline: Timeline | None = None,
                 virtual_stages: int = 1) -> None:
        self.module = module
        self.v = virtual_stages
        self.timeline = timeline
        self.static_shapes = static_shapes
        Shape = tuple[torch.dtype, tuple[int, ...]]
        self.sent_shapes: dict[tuple[int, int], Shape] = {}  # (micro-batch, chunk) -> what its F sent
        self.recv_shapes: dict[tuple[int, int], Shape] = {}  # (micro-batch, chunk) -> what its F got
        self.held_bytes: dict[tuple[int, int], int] = {}  # static shapes: bytes an F kept (measured once)
        self.group = pp_group
        self.peers = Peers(pp_group)
        self.stage = self.peers.rank if stage is None else stage
        self.n_stages = self.peers.size if n_stages is None else n_stages
        if (self.stage, self.n_stages) != (self.peers.rank, self.peers.size):
            raise UserError(f"stage {self.stage} of {self.n_stages} does not match this rank's place in the "
                            f"pp group (rank {self.peers.rank} of {self.peers.size}); stages are the "
                            "group's ranks in order")
        if self.is_last and loss_fn is None:
            raise UserError("the last pipeline stage needs loss_fn=, e.g. lambda out, y: "
                            "F.cross_entropy(out.flatten(0, 1), y.flatten())")
        self.loss_fn = loss_fn
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        ranks = range(self.peers.size)
        whole = pp_group is None or pp_group == dist.group.WORLD
        self._global = list(ranks) if whole else [dist.get_global_rank(pp_group, r) for r in ranks]
        # (name, micro-batches) -> this stage's actions, and per action whether the ideal run idles before it
        self._schedules: dict[tuple[str, int], tuple[list[Action], list[bool]]] = {}
        self.history: list[StepStats] = []

    @property
    def n_virtual(self) -> int:
        return self.n_stages * self.v

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def actions(self, name: str, n_microbatches: int) -> list[Action]:
        """This stage's actions under the registered schedule `name` (validated once, then cached)."""
        key = (name, n_microbatches)
        if key not in self._schedules:
            schedule = make_schedule(name, self.n_stages, n_microbatches, self.v)
            validate(schedule, n_microbatches)
            self._schedules[key] = schedule[self.stage], idle_before(schedule)[self.stage]
        return self._schedules[key][0]

    # ---- forward only

    @torch.no_grad()
    def infer(self, x: torch.Tensor | None, module: nn.Module | None = None) -> torch.Tensor | None:
        """One batch forward, no gradients: the first stage takes `x`, the others receive their
        input. Returns the last stage's output (None on the others). `module`: run this instead
        of the stage's module (the bare model under a data-parallel engine)."""
        module = self.module if module is None else module
        p, last = self.n_stages, self.n_virtual - 1
        for chunk in range(self.v):
            u = chunk * p + self.stage
            if u == 0:
                h = x.to(self.device)
            else:
                header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                self.peers.irecv(header, (self.stage - 1) % p, INFER_TAG + 3 * (u - 1) + HEADER_TAG).wait()
                dtype, ndim = DTYPES[int(header[0])], int(header[1])
                h = torch.empty(header[2: 2 + ndim].tolist(), dtype=dtype, device=self.device)
                self.peers.irecv(h, (self.stage - 1) % p, INFER_TAG + 3 * (u - 1) + ACTIVATION_TAG).wait()
            out = module(h) if self.v == 1 else module(h, chunk=chunk)
            if u == last:
                return out
            out, peer = out.contiguous(), (self.stage + 1) % p
            for work in (self.peers.isend(header_of(out), peer, INFER_TAG + 3 * u + HEADER_TAG),
                         self.peers.isend(out, peer, INFER_TAG + 3 * u + ACTIVATION_TAG)):
                work.wait()
        return None

    # ---- one step

    def step(self, schedule: str | Sequence[Action | str], inputs: Sequence[torch.Tensor] | None = None,
             targets: Sequence[torch.Tensor] | None = None, *, n_microbatches: int | None = None,
             no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
             broadcast_loss: bool = False) -> tuple[torch.Tensor | None, StepStats]:
        """Run this stage's part of one training step; gradients accumulate in the module's `.grad`.

        `schedule`: this stage's actions ("F0", "B0", ... or `Action`s), or a schedule name with
        `n_microbatches` (inferred from `inputs` or `targets` where this stage has them).
        `inputs` are used on the first stage, `targets` on the last, one per micro-batch; other
        stages ignore them. Micro-batch i's loss weighs len(targets[i]) / total, so the gradient
        equals the whole batch's mean-loss gradient. `no_sync` (e.g. `engine.no_sync`) wraps every
        backward but this stage's last, so the data-parallel sync overlaps the last backward.
        Returns the batch's mean loss (detached) on the last stage, else None; on every stage with
        `broadcast_loss` (a broadcast over the pp group, which all stages must then ask for).
        """
        if isinstance(schedule, str):
            m = n_microbatches or (len(inputs) if self.is_first and inputs is not None else None) or (
                len(targets) if self.is_last and targets is not None else None)
            if m is None:
                raise UserError(f"stage {self.stage} cannot tell the number of micro-batches; "
                                "pass n_microbatches=")
            actions = self.actions(schedule, m)
            fill_drain = self._schedules[schedule, m][1]
        else:
            fill_drain = None
            actions = [Action.parse(a) for a in schedule]
            m = len({a.microbatch for a in actions if a.kind == "F"})
            try:
                validate([actions], m)
            except UserError as e:
                raise UserError(f"stage {self.stage}'s actions: {e}") from None
        if m < 1:
            raise UserError(f"stage {self.stage} got no forward actions; give at least one micro-batch")
        for what, given, needed in (("inputs", inputs, self.is_first), ("targets", targets, self.is_last)):
            if needed and (given is None or len(given) != m):
                raise UserError(f"stage {self.stage} needs {what}= with one tensor per micro-batch "
                                f"({m}), got {'none' if given is None else len(given)}")
        weights: list[float] = []
        if self.is_last:
            sizes = [len(t) if t.dim() else 1 for t in targets]
            weights = [n / sum(sizes) for n in sizes]
        run = StepRun(self, actions, inputs, targets, weights, no_sync, fill_drain)
        loss, stats = run.execute()
        self.history.append(stats)
        if broadcast_loss and self.n_stages > 1:
            if loss is None:
                loss = torch.zeros((), device=self.device)
            dist.broadcast(loss, src=self._global[-1], group=self.group)
        return loss, stats
