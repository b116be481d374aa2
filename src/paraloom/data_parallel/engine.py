"""DataParallel: per-parameter hooks -> buckets -> scheduler -> collectives, overlapping backward.

Gradients live in flat bucket buffers (`p.grad` is a view, so nothing is copied per step).
As backward produces the last gradient of a bucket, the bucket's pieces (the whole bucket, or
partitions of it under the priority scheduler) are handed to the scheduler, which launches
their collectives in one order on every rank. Buckets, pieces, policy, executor and updater are
one value, the engine's `layout` (layout.py), swapped whole by `relayout()`. What happens after backward
(`engine.step(optimizer)`) is the updater's business, picked in updaters.py: synchronous
averaging (synchronous.py), deferred per-module updates (priority.py), one-step-delay SGD
(delayed.py), local SGD (local_sgd.py) or a sharded optimizer (shard.py). Parameters that got
no gradient in a step count as zero.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Joinable

from paraloom.comm.algorithms import all_reduce
from paraloom.comm.collectives import CommStats, ThenOnWait, private_group
from paraloom.comm.executor import CommThread
from paraloom.comm.policies import CommTask
from paraloom.compress import make_compressor
from paraloom.config.rules import check_dp_options
from paraloom.data_parallel import ddp_args
from paraloom.data_parallel.auto import CANDIDATES, START_BUCKET_MB, AutoScheduler
from paraloom.data_parallel.bucket import Bucket, Piece
from paraloom.data_parallel.ddp_interface import DDPInterface
from paraloom.data_parallel.join import JoinRun
from paraloom.data_parallel.layout import CommLayout, build_layout
from paraloom.data_parallel.lowrank import PowerSGDReducer
from paraloom.data_parallel.states import sync_states
from paraloom.data_parallel.synchronous import DONE
from paraloom.data_parallel.unused import UnusedParameters
from paraloom.optim.finite import all_finite, not_finite

MB = 2**20
_D = ddp_args.DEFAULTS


class DataParallel(DDPInterface, nn.Module, Joinable):
    """A drop-in for `torch.nn.parallel.DistributedDataParallel`; see the module docstring.

    DDP's arguments (`*ddp_positional`, `**ddp_keywords`) bind as in the installed torch's DDP, positionally
    in its order or by name (`ddp_args` says what each means here). paraloom's options are keywords:
    the comm.* config keys, or all at once from `comm=CommConfig(...)`, and its wiring: the
    data-parallel group as `group=` (DDP's `process_group=`) or from `topology=` (a `Topology`,
    whose groups are made here, or the `RankGroups` it made), `stats=`, `timeline=`, `comm_group=`
    (the group of a scheduler that needs one of its own), `compressor_options=`.
    """

    def __init__(self, module: nn.Module, *ddp_positional, group: dist.ProcessGroup | None = None,
                 topology=None, comm=None, bucket_mb: float | str = _D.bucket_mb,
                 first_bucket_mb: float = _D.first_bucket_mb, scheduler: str = _D.scheduler,
                 algorithm: str = _D.algorithm, sync: str = _D.sync, local_steps: int = _D.local_steps,
                 local_warmup: int = _D.local_warmup, shard_optimizer: bool = _D.shard_optimizer,
                 partition_mb: float = _D.partition_mb, credit_mb: float = _D.credit_mb,
                 delay_lr: float | None = _D.delay_lr, compressor: str | None = _D.compressor,
                 compressor_options: dict | None = None, stats: CommStats | None = None, timeline=None,
                 comm_group: dist.ProcessGroup | None = None, **ddp_keywords) -> None:
        super().__init__()
        Joinable.__init__(self)  # join(): disabled until a Join context enables it
        self.join_run = JoinRun()  # inside join(): what this step's gradients are divided by
        given = ddp_args.bind(module, ddp_positional, ddp_keywords)
        ddp = ddp_args.resolve(given, group=group, bucket_mb=bucket_mb)
        o = ddp_args.engine_options(comm, compressor_options, bucket_mb=bucket_mb,
                                    first_bucket_mb=first_bucket_mb, scheduler=scheduler, algorithm=algorithm,
                                    sync=sync, local_steps=local_steps, local_warmup=local_warmup,
                                    shard_optimizer=shard_optimizer, partition_mb=partition_mb,
                                    credit_mb=credit_mb, delay_lr=delay_lr, compressor=compressor)
        if comm is None:
            o["bucket_mb"] = ddp["bucket_mb"]
        group = ddp_args.data_parallel_group(topology, ddp["group"])
        scheduler, algorithm, compressor = o["scheduler"], o["algorithm"], o["compressor"]
        # refuse bad options before touching the model or the group
        check_dp_options(**{k: o[k] for k in ("sync", "scheduler", "shard_optimizer", "algorithm",
                                              "local_steps", "local_warmup", "credit_mb", "compressor",
                                              "bucket_mb")})
        self.compressor = None
        if compressor == "powersgd":
            self.compressor = PowerSGDReducer(**o["compressor_options"])
        elif compressor != "none":
            self.compressor = make_compressor(compressor, **o["compressor_options"])
        self.device_ids = ddp["device_ids"]
        # DDP's find_unused_parameters: a parameter no rank used keeps its gradient (unused.py)
        self.find_unused = bool(given["find_unused_parameters"])
        self.forward_sync_buffers = ddp["forward_sync_buffers"]  # DDP's broadcast_buffers
        self.comm_hook = None  # (state, hook) once register_comm_hook() is called
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.algorithm = algorithm
        self.stats = stats if stats is not None else CommStats()
        self.timeline = timeline
        self.comm_options = o  # the comm.* options as given (bucket_mb: the layout's says what is used)
        self._given_comm_group, self._private = comm_group, None
        self._thread = CommThread() if algorithm != "native" and self.world_size > 1 else None
        self._nonfinite: torch.Tensor | None = None  # set by guard_nonfinite(): a flag the grad hooks raise
        self.guard_group: dist.ProcessGroup | None = None  # where guard_nonfinite()'s flag is all-reduced
        self._guard_sums = False  # guard_nonfinite() on the averaged gradients, without a flag
        self._guard_asked: tuple | None = None  # guard_nonfinite()'s arguments, once called
        self._sync = True  # False inside no_sync()
        self.reduce_in_backward = True  # the updater turns this off for steps without gradient traffic
        self.copies = 0  # gradients that arrived outside their bucket and had to be copied in
        self.forward_done_at = 0.0
        self.ready_at: dict[int, float] = {}  # piece key -> seconds from end of forward to ready
        self.piece_times: dict[int, list[float]] | None = None  # when set: key -> [launched, done]
        self.backward_started = False
        self._end_queued = False  # the end-of-backward callback is queued for this backward
        self._synced = False  # the gradients are averaged and nothing has arrived since
        self._launched_in_backward = 0
        self._stepping = 0  # > 0 while the engine drives the optimizer (plain step() is refused otherwise)
        self.require_forward_param_sync = True  # as DDP's: buffers are synced before the next forward
        sync_states(module, group, ddp["init_sync"], ddp["init_sync_buffers"])
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]  # ~ backward order
        # removed by close(), so a closed engine leaves the model as it found it
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        # find_unused_parameters: which parameters got a gradient (noted before the buckets bind them)
        self.unused = UnusedParameters(self.params) if self.find_unused else None
        self.auto = None  # comm.scheduler=auto or comm.bucket_mb=auto: trials on the first steps
        bucket_mb = o["bucket_mb"]
        sizes_tried = bucket_mb == "auto"
        if scheduler == "auto" or sizes_tried:
            bucket_mb = START_BUCKET_MB if sizes_tried else bucket_mb
            self.auto = AutoScheduler(self, bucket_mb, buckets=sizes_tried,
                                      schedulers=CANDIDATES if scheduler == "auto" else (scheduler,))
            scheduler = self.auto.start()
        self.layout: CommLayout = build_layout(self, scheduler, bucket_mb)
        self.reset_comm()

    # ---- the communication layout (layout.py): read through these, swapped whole by relayout()

    @property
    def scheduler(self) -> str:
        return self.layout.scheduler

    @property
    def policy(self):
        return self.layout.policy

    @property
    def executor(self):
        return self.layout.executor

    @property
    def comm_group(self) -> dist.ProcessGroup | None:
        return self.layout.comm_group

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    @property
    def pieces(self) -> list[list[Piece]]:
        return self.layout.pieces

    @property
    def n_pieces(self) -> int:
        return self.layout.n_pieces

    @property
    def updater(self):
        return self.layout.updater

    def relayout(self, scheduler: str, bucket_mb: float | None = None) -> None:
        """Rebuild the communication layout for `scheduler` (and `bucket_mb`; None: the current one),
        between steps: what is pending lands, the old layout's executor and hooks go, the new
        layout is built, and the non-finite guard, if asked for, is asked again for the new updater."""
        self.finish()
        self.layout.close()
        self.layout = build_layout(self, scheduler, self.layout.bucket_mb if bucket_mb is None else bucket_mb)
        self.reset_comm()
        if self._guard_asked is not None:
            self.guard_nonfinite(*self._guard_asked)

    def private_comm_group(self) -> dist.ProcessGroup:
        """The group of a scheduler whose launches follow this rank's own progress (`own_group`):
        `comm_group=` if given, else a twin of the data-parallel group, made once and kept."""
        if self._private is None:
            self._private = self._given_comm_group or private_group(self.group)
        return self._private

    def forward(self, *args, **kwargs):
        self._pre_forward()
        out = self.module(*args, **kwargs)
        self._post_forward()
        return out

    # ---- backward: hooks -> buckets -> scheduler

    def reset_comm(self) -> None:
        """The executor and the buckets ready for the next step (nothing may be in flight)."""
        self.layout.executor.reset()
        self.reset_buckets()

    def reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.seen.clear()

    def _on_grad(self, p: nn.Parameter) -> None:
        # once per parameter and backward: nn.Module's __setattr__ costs microseconds (it checks
        # for parameters and submodules), so state is written only when it changes
        layout = self.layout  # read once: this runs once per parameter and backward
        bucket, slot = layout.slot[p]
        if bucket.bind(slot):
            self.copies += 1
        if self._synced:
            self._synced = False
        if not self.backward_started:
            self.backward_started = True
        plain = layout.updater.plain_optimizer_step
        if self._sync and self.reduce_in_backward and plain and not self._end_queued:
            # as DDP: the gradients are averaged by the time backward returns, so a plain
            # `optimizer.step()` reads them (autograd runs this once the whole backward is done)
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        # before the gradient is sent; under no_sync() the synced backward checks the sum (NaN/Inf stay)
        if self._nonfinite is not None and self._sync:
            self._nonfinite.logical_or_(not_finite(p.grad))
        unused = self.unused
        if unused is not None:
            unused.used.add(p)
        if not (self._sync and self.reduce_in_backward):
            return
        if slot in bucket.seen:
            raise RuntimeError(f"a second backward ran before the step ({type(layout.updater).__name__} "
                               "updates once per backward): call optimizer.step() between backward passes, "
                               "or accumulate micro-batches inside `with model.no_sync():`")
        bucket.seen.add(slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.bucket_ready(bucket)

    def bucket_ready(self, bucket: Bucket) -> None:
        """Every gradient of `bucket` is in: its pieces go to the executor, which launches them as
        the policy says."""
        now = time.perf_counter() - self.forward_done_at
        layout = self.layout
        for piece in layout.pieces[bucket.index]:
            self.ready_at[piece.key] = now
            layout.executor.mark_ready(CommTask(piece.key, piece.nbytes,
                                                launch=lambda piece=piece: self._launch(piece)))

    def _launch(self, piece: Piece):
        if self.world_size == 1:
            return DONE
        on_done = None
        if self.piece_times is not None:
            times = self.piece_times[piece.key] = [time.perf_counter() - self.forward_done_at, 0.0]

            def on_done():
                times[1] = time.perf_counter() - self.forward_done_at
        return self.layout.updater.launch(piece, on_done)

    def complete_missing(self) -> None:
        """After backward: parameters that got no gradient count as zero; their buckets become ready."""
        for bucket in self.buckets:
            if bucket.pending:
                for slot in range(len(bucket.params)):
                    if slot not in bucket.seen:
                        bucket.bind(slot)
                        if self._nonfinite is not None:  # what no_sync() accumulated, unchecked so far
                            self._nonfinite.logical_or_(not_finite(bucket.views[slot]))
                bucket.pending = 0
                self.bucket_ready(bucket)

    # ---- collectives (one issuing order; the comm thread for algorithms written on P2P)

    def run_async(self, name: str, nbytes: int, native: Callable[[], dist.Work] | None,
                  blocking: Callable[[], object], on_done: Callable[[], None] | None = None):
        """Start one collective: `native()` returns an async work; `blocking()` runs on the comm thread.

        `on_done` (and the trace's comm span) run when it completes, on whichever thread sees it.
        `nbytes` — what this rank hands to the collective — is what the comm stats count.
        """
        self.stats.bytes += nbytes
        self.stats.calls += 1
        timeline = self.timeline
        start = time.perf_counter()
        callbacks = [on_done] if on_done is not None else []
        if timeline is not None and timeline.active:
            callbacks.append(lambda: timeline.span(name, "comm", start, timeline.now(), bytes=nbytes))

        def finished(*_):
            for callback in callbacks:
                callback()

        if self._thread is None:
            work = native()
            if callbacks:
                try:
                    work.get_future().add_done_callback(finished)
                except RuntimeError:  # gloo's reduce-scatter has no future: run them once waited for
                    return ThenOnWait(work, finished)
            return work
        if callbacks:
            return self._thread.submit(lambda: (blocking(), finished()))
        return self._thread.submit(blocking)

    def all_reduce_async(self, tensor: torch.Tensor, name: str, on_done: Callable[[], None] | None = None):
        group = self.layout.comm_group
        return self.run_async(name, tensor.numel() * tensor.element_size(),
                              lambda: dist.all_reduce(tensor, group=group, async_op=True),
                              lambda: all_reduce(tensor, algorithm=self.algorithm, group=group),
                              on_done)

    def piece_name(self, piece: Piece) -> str:
        if len(self.pieces[piece.bucket.index]) == 1:
            return f"bucket {piece.bucket.index}"
        return f"bucket {piece.bucket.index} part {piece.key}"

    # ---- after backward

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After backward: reduce whatever is not in flight yet, wait for all, average `.grad`.

        Runs by itself at the end of each synchronized backward (as DDP's reducer does), so the
        plain loop's `optimizer.step()` reads averaged gradients; calling it again is a no-op until
        new gradients arrive. The classic `sync_gradients(); optimizer.step()` loop still works.
        """
        if self._synced:
            return
        self.updater.check_classic()
        self.complete_missing()
        start = time.perf_counter()
        self.layout.executor.wait_all(self.layout.n_pieces)
        self.stats.seconds += time.perf_counter() - start  # time not hidden behind backward
        if self.world_size > 1 and self.comm_hook is None:  # a comm hook returns the average itself
            n = self.join_run.divisor(self.world_size)
            for bucket in self.layout.buckets:
                bucket.buffer.div_(n)
        self.reset_comm()
        self._synced = True
        if self.unused is not None and self.layout.updater.plain_optimizer_step:
            self.unused.release(self.group, self.join_device)

    def guard_nonfinite(self, group: dist.ProcessGroup | None = None) -> None:
        """From now on `step()` skips, on every rank alike, a step whose gradients hold NaN or Inf
        on any rank.

        Plain synchronous averaging (`SyncUpdater.guards_on_sums`), uncompressed or cast to fp16 or
        bf16 without error feedback (`carries_nonfinite`), with no `group` given needs no
        communication of its own: every rank checks the averaged gradients,
        which are the same on every rank and carry any rank's NaN or Inf. Otherwise the backward
        hooks raise a local flag (no sync), and `step()` all-reduces it on `group` (one byte; made
        here when not given, a second group over the same ranks, so the flag never interleaves with
        the engine's own collectives): a blocking collective per step, and a barrier before it.
        """
        self._guard_asked = (group,)  # comm.scheduler=auto asks again for the scheduler it settles on
        self._guard_sums, self._nonfinite = False, None
        carried = self.compressor is None or getattr(self.compressor, "carries_nonfinite", False)
        if group is None and self.updater.guards_on_sums and carried:
            self._guard_sums = True
            return
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.buckets[0].buffer.device
                                      if self.buckets else None)
        if self.world_size > 1:
            self.guard_group = group if group is not None else self.guard_group or private_group(self.group)

    def gradients_finite(self) -> bool:
        """Whether every gradient bucket holds only finite values (`finite.all_finite`)."""
        return all_finite([bucket.buffer for bucket in self.buckets])

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """After backward: synchronize as the updater says, update with `optimizer`, zero gradients.

        Returns False when the non-finite guard (`guard_nonfinite`) skipped the step.
        """
        with self.stepping():
            stepped = self._guarded_step(optimizer)
        if self.auto is not None:  # comm.scheduler=auto: timing its trials, or switching between them
            self.auto.after_step()
        return stepped

    def _guarded_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._guard_sums:
            return self.updater.step_if_finite(optimizer)
        if self._nonfinite is not None:
            flag = self._nonfinite.to(torch.uint8)
            self._nonfinite.zero_()
            if self.guard_group is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.guard_group)
            if flag.item():
                self.skip_step()
                return False
        self.updater.step(optimizer)
        return True

    @torch.no_grad()
    def skip_step(self) -> None:
        """Drop this step's gradients: wait for what is in flight, reset, zero; no update.

        Error-feedback memories that the bad gradients reached are dropped with them.
        """
        if self.reduce_in_backward and self._sync and not self._synced:  # not yet landed at backward's end
            self.complete_missing()
            self.layout.executor.wait_all(self.layout.n_pieces)
        self.reset_comm()
        self.zero_grad()
        if self.compressor is not None:
            from paraloom.compress.state import drop_nonfinite

            drop_nonfinite(self.compressor)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for communication in flight and apply deferred updates (before evaluating or saving)."""
        with self.stepping():
            self.updater.finish()

    @torch.no_grad()
    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def comm_state_dict(self) -> dict:
        """This rank's communication state for a checkpoint: the updater's and the compressor's.

        (`state_dict()` is the wrapped module's, under `module.` keys, as DDP's is.)

        Call between steps. In-flight collectives are waited for; nothing a later step computes
        changes (parameters and optimizer state are the caller's to save).
        """
        from paraloom.compress.state import state_dict_of

        return {"updater": self.updater.state_dict(),
                "compressor": state_dict_of(self.compressor) if self.compressor is not None else None}

    def load_comm_state_dict(self, state: dict, *, keep_compressor: bool = True) -> None:
        from paraloom.compress.state import load_state_of

        self.updater.load_state_dict(state["updater"])
        if not keep_compressor:
            return
        if (state["compressor"] is None) != (self.compressor is None):
            raise ValueError("the checkpoint's compressor setting differs from this engine's")
        if self.compressor is not None:
            load_state_of(self.compressor, state["compressor"])

    @property
    def replicas_identical(self) -> bool:
        """Whether parameters and optimizer state are equal on every rank between steps."""
        return self.updater.replicas_identical

    def close(self) -> None:
        with contextlib.suppress(Exception), self.stepping():
            self.finish()
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.layout.close()
        if self._thread is not None:
            self._thread.close()
            self._thread = None


