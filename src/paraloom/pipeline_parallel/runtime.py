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

One step on one stage (`StepRun`): its receives posted ahead, its sends, what each forward keeps.

`StepRun` executes a stage's actions for `PipelineStage.step`: per F it takes the
micro-batch's input (the first virtual stage's `inputs[i]`, else the activation received from the
previous virtual stage), runs the chunk and sends the output on, or on the last virtual stage
computes the scaled loss; per B it back-propagates the gradient received from the next virtual
stage and sends the input's gradient back. Receives are posted LOOKAHEAD actions ahead; sends are
asynchronous and waited for at the end of the step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.p2p import Peers
from paraloom.config.errors import UserError
from paraloom.pipeline_parallel.schedules import Action, idle_before, make_schedule, validate
from paraloom.trace.timeline import Timeline, WorkSpans

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool]
HEADER = 16  # int64 slots: dtype code, ndim, then the shape
LOOKAHEAD = 2  # actions whose receives are posted before they run
HEADER_TAG, ACTIVATION_TAG, GRAD_TAG = range(3)
INFER_TAG = 1 << 20  # forward-only messages (`infer`): beyond any step's micro-batch tags


def _tag(microbatch: int, boundary: int, channel: int, n_virtual: int) -> int:
    """The tag of a message across `boundary` (virtual stage u to u + 1) for `microbatch`."""
    return (microbatch * n_virtual + boundary) * 3 + channel


def header_of(t: torch.Tensor) -> torch.Tensor:
    """The HEADER int64 slots announcing `t`: dtype code, ndim, then the shape."""
    header = torch.zeros(HEADER, dtype=torch.int64, device=t.device)
    header[0], header[1] = DTYPES.index(t.dtype), t.dim()
    header[2: 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


@dataclass
class StepStats:
    """What one stage measured during one step."""

    step_seconds: float  # wall time of `step`, from the first action to the last send completed
    busy_seconds: float  # forward and backward compute, waits excluded
    peak_activation_bytes: int  # most bytes held for backward at once (saved tensors, inputs, outputs)
    n_microbatches: int
    # time between actions where the ideal schedule has none (`schedules.idle_before`): waits for a
    # neighbour's uneven compute and the runtime's own work, apart from the fill and drain (0 when
    # the stage ran a list of actions rather than a named schedule)
    steady_wait_seconds: float = 0.0

    @property
    def bubble(self) -> float:
        """Share of the step this stage spent not computing (waiting for its neighbours)."""
        return 1 - self.busy_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


def _storage_of(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage; a DTensor's (a sharded parameter) is its local shard's."""
    t = t.to_local() if hasattr(t, "to_local") else t
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
        return None


class _Held:
    """Bytes of distinct storages one micro-batch keeps alive for its backward (parameters excluded)."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.storages = skip, {}

    def add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
            return
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


class StepRun:
    """The state of one step on one stage: posted receives, pending sends, what an F keeps for its B."""

    def __init__(self, stage: PipelineStage, actions: list[Action], inputs, targets, weights,
                 no_sync, fill_drain: list[bool] | None = None) -> None:
        self.s, self.actions = stage, actions
        self.fill_drain = fill_drain  # per action: whether the ideal schedule idles before it
        self.inputs, self.targets, self.weights = inputs, targets, weights
        self.no_sync = no_sync
        self.last_backward = max(k for k, a in enumerate(actions) if a.kind == "B")
        self.posted: dict[Action, list] = {}  # action -> [header work, header, data work, data]
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        # (micro-batch, chunk) -> (input, output|loss, bytes)
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.params = {_storage_of(p) for p in stage.module.parameters()}
        self.busy = self.steady_wait = 0.0
        self.k, self.last_end = 0, 0.0  # the action running; when the previous one's compute ended
        self.held = self.peak = 0
        self.loss = torch.zeros((), device=stage.device) if stage.is_last else None
        self.prev, self.next = (stage.stage - 1) % stage.n_stages, (stage.stage + 1) % stage.n_stages
        timeline = stage.timeline
        self.timeline = timeline if timeline is not None and timeline.active else None
        # gloo (CPU tensors) sends report completion only through wait(): WorkSpans waits for them
        self.clock = None if self.timeline is None else WorkSpans(self.timeline, "p2p",
                                                                  owns_wait=stage.device.type == "cpu")

    def virtual(self, action: Action) -> int:
        """The virtual stage `action` runs on: chunk c of stage s is c p + s."""
        return action.chunk * self.s.n_stages + self.s.stage

    def tag(self, action: Action, boundary: int, channel: int) -> int:
        return _tag(action.microbatch, boundary, channel, self.s.n_virtual)

    def execute(self) -> tuple[torch.Tensor | None, StepStats]:
        start = self.last_end = time.perf_counter()
        for k, action in enumerate(self.actions):
            self.k = k
            self.prefetch(k)
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
            if action.kind == "F":
                self.forward(action)
            else:
                self.backward(action, last=k == self.last_backward)
        for work, _ in self.sends:
            work.wait()
        if self.clock is not None:
            self.clock.join()
        stats = StepStats(time.perf_counter() - start, self.busy, self.peak,
                          len({a.microbatch for a in self.actions if a.kind == "F"}), self.steady_wait)
        return self.loss, stats

    # ---- receives

    def prefetch(self, k: int) -> None:
        """Post the receives of the next LOOKAHEAD actions (a gradient once its forward ran)."""
        s = self.s
        for action in self.actions[k: k + LOOKAHEAD + 1]:
            key, u = (action.microbatch, action.chunk), self.virtual(action)
            if action.kind == "F" and u > 0:
                slot = self.posted.setdefault(action, [None, None, None, None])
                if slot[2] is not None:  # posted by an earlier prefetch (a stray header receive here
                    continue  # would take the header of a later stage object's step: it hung)
                if s.static_shapes and key in s.recv_shapes:  # no header: shape known
                    dtype, shape = s.recv_shapes[key]
                    slot[3] = torch.empty(shape, dtype=dtype, device=s.device)
                    slot[2] = s.peers.irecv(slot[3], self.prev, self.tag(action, u - 1, ACTIVATION_TAG))
                    continue
                if slot[0] is None:
                    slot[1] = torch.empty(HEADER, dtype=torch.int64, device=s.device)
                    slot[0] = s.peers.irecv(slot[1], self.prev, self.tag(action, u - 1, HEADER_TAG))
                if slot[2] is None and slot[0].is_completed():
                    self.post_activation(action, slot)
            elif (action.kind == "B" and u < s.n_virtual - 1 and action not in self.posted
                  and key in self.kept):
                out = self.kept[key][1]
                grad = torch.empty(out.shape, dtype=out.dtype, device=s.device)
                work = s.peers.irecv(grad, self.next, self.tag(action, u, GRAD_TAG))
                self.posted[action] = [None, None, work, grad]

    def post_activation(self, action: Action, slot: list) -> None:
        slot[0].wait()
        header = slot[1].tolist()
        dtype, shape = DTYPES[header[0]], header[2: 2 + header[1]]
        self.s.recv_shapes[action.microbatch, action.chunk] = (dtype, tuple(shape))
        slot[3] = torch.empty(shape, dtype=dtype, device=self.s.device)
        boundary = self.virtual(action) - 1
        slot[2] = self.s.peers.irecv(slot[3], self.prev, self.tag(action, boundary, ACTIVATION_TAG))

    def receive(self, action: Action) -> torch.Tensor:
        slot, timeline = self.posted.pop(action), self.timeline
        start = timeline.now() if timeline is not None else 0.0
        if slot[2] is None:
            self.post_activation(action, slot)
        slot[2].wait()
        if timeline is not None and (end := timeline.now()) > start:
            timeline.span(f"wait {action}", "p2p", start, end, stage=self.s.stage,
                          microbatch=action.microbatch)
        return slot[3]

    def send(self, tensor: torch.Tensor, peer: int, tag: int,
             traced: tuple[Action, float] | None = None) -> None:
        """Post an isend; `traced` = (action, start) puts its span on the send clock."""
        work = self.s.peers.isend(tensor, peer, tag)
        if traced is not None and self.clock is not None:
            action, start = traced
            self.clock.watch(peer, work, f"send {action} to stage {peer}", start, keep=tensor,
                             stage=self.s.stage, microbatch=action.microbatch,
                             bytes=tensor.numel() * tensor.element_size())
            if self.clock.owns_wait:
                return
        self.sends.append((work, tensor))

    def computed(self, action: Action, start: float, end: float) -> None:
        """Count one action's compute and, where the ideal schedule has no idle before it, the gap."""
        self.busy += end - start
        if self.fill_drain is not None and not self.fill_drain[self.k]:
            self.steady_wait += start - self.last_end
        self.last_end = end
        if self.timeline is not None:
            self.timeline.span(str(action), "compute", start, end, stage=self.s.stage,
                               microbatch=action.microbatch)

    # ---- compute

    def forward(self, action: Action) -> None:
        s, i = self.s, action.microbatch
        key, u = (i, action.chunk), self.virtual(action)
        last = u == s.n_virtual - 1
        if u == 0:
            x = self.inputs[i].to(s.device)
        else:
            x = self.receive(action)
            if x.is_floating_point():
                x.requires_grad_(True)
        held = _Held(self.params)
        known = s.held_bytes.get(key) if s.static_shapes else None  # same shapes: same bytes as before
        start = time.perf_counter()
        with (torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t) if known is None
              else contextlib.nullcontext()):
            out = s.module(x) if s.v == 1 else s.module(x, chunk=action.chunk)
            if last:
                out = s.loss_fn(out, self.targets[i].to(s.device)) * self.weights[i]
        self.computed(action, start, time.perf_counter())
        held.add(x)
        if last:
            self.loss += out.detach()
        else:
            self.send_on(action, out.detach().contiguous(), held)
        nbytes = held.nbytes if known is None else known
        if s.static_shapes:
            s.held_bytes[key] = nbytes
        self.kept[key] = (x, out, nbytes)
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def send_on(self, action: Action, outgoing: torch.Tensor, held: _Held) -> None:
        """An F's output to the next virtual stage, its header first unless static shapes know it."""
        s, key, u = self.s, (action.microbatch, action.chunk), self.virtual(action)
        held.add(outgoing)
        if len(outgoing.shape) > HEADER - 2 or outgoing.dtype not in DTYPES:
            raise UserError(f"stage {s.stage} output {outgoing.dtype} {tuple(outgoing.shape)} cannot be "
                            f"sent: the pipeline carries tensors of at most {HEADER - 2} dims of "
                            f"dtypes {DTYPES}")
        sent = (outgoing.dtype, tuple(outgoing.shape))
        traced = None if self.timeline is None else (action, self.timeline.now())  # header included
        if s.static_shapes and key in s.sent_shapes:
            if s.sent_shapes[key] != sent:
                raise UserError(f"stage {s.stage}: micro-batch {action.microbatch}'s activation changed "
                                f"from {s.sent_shapes[key]} to {sent} under static_shapes=True; keep "
                                "micro-batch shapes fixed or build the stage with static_shapes=False")
        else:
            self.send(header_of(outgoing), self.next, self.tag(action, u, HEADER_TAG))
            s.sent_shapes[key] = sent
        self.send(outgoing, self.next, self.tag(action, u, ACTIVATION_TAG), traced)

    def backward(self, action: Action, last: bool) -> None:
        s, u = self.s, self.virtual(action)
        grad = None if u == s.n_virtual - 1 else self.receive(action)
        x, out, nbytes = self.kept.pop((action.microbatch, action.chunk))
        context = self.no_sync() if self.no_sync is not None and not last else contextlib.nullcontext()
        start = time.perf_counter()
        with context:
            torch.autograd.backward(out, grad)
        self.computed(action, start, time.perf_counter())
        if u > 0:
            dx = x.grad if x.grad is not None else torch.zeros_like(x)
            traced = None if self.timeline is None else (action, self.timeline.now())
            self.send(dx.contiguous(), self.prev, self.tag(action, u - 1, GRAD_TAG), traced)
        self.held -= nbytes


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
