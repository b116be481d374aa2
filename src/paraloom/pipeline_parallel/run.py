"""One pipeline step on one stage: its receives posted ahead, its sends, what each forward keeps.

`StepRun` executes a stage's actions for `PipelineStage.step` (runtime.py): per F it takes the
micro-batch's input (the first virtual stage's `inputs[i]`, else the activation received from the
previous virtual stage), runs the chunk and sends the output on, or on the last virtual stage
computes the scaled loss; per B it back-propagates the gradient received from the next virtual
stage and sends the input's gradient back. Receives are posted LOOKAHEAD actions ahead; sends are
asynchronous and waited for at the end of the step.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from paraloom.errors import UserError
from paraloom.pipeline_parallel.schedules import Action
from paraloom.trace.timeline import WorkSpans

if TYPE_CHECKING:
    from paraloom.pipeline_parallel.runtime import PipelineStage

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
        self.params = {p.untyped_storage().data_ptr() for p in stage.module.parameters()}
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
