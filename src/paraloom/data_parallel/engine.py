"""DataParallel: per-parameter hooks -> buckets -> scheduler -> all-reduce, overlapping backward.

Gradients live in flat bucket buffers (`p.grad` is a view, so nothing is copied per step).
As backward produces the last gradient of a bucket, the bucket is handed to the scheduler,
which launches its all-reduce (`wait_free`) or holds it to the end (`fifo`); buckets are
always launched in the same order on every rank. `sync_gradients()` after backward launches
what is left, waits, and averages. Parameters that got no gradient in a step count as zero.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.algorithms import all_reduce, check_algorithm
from paraloom.comm.collectives import CommStats, broadcast
from paraloom.comm.schedule import CommTask, CommThread, Executor, make_scheduler
from paraloom.data_parallel.bucket import Bucket, assign_buckets

MB = 2**20


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, scheduler: str = "wait_free",
                 algorithm: str = "native", stats: CommStats | None = None) -> None:
        super().__init__()
        check_algorithm(algorithm)
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.algorithm = algorithm
        self.stats = stats if stats is not None else CommStats()
        self._executor = Executor(make_scheduler(scheduler))
        self._thread = CommThread() if algorithm != "native" and self.world_size > 1 else None
        self._sync = True
        self.copies = 0  # gradients that arrived outside their bucket and had to be copied in
        with torch.no_grad():  # every replica starts from group rank 0's state, as DDP does
            for tensor in [*module.parameters(), *module.buffers()]:
                broadcast(tensor.data, group=group)
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # ~ backward order
        groups = assign_buckets([(p.numel() * p.element_size(), p.dtype) for p in params],
                                int(bucket_mb * MB), int(first_bucket_mb * MB))
        self.buckets = [Bucket.build(i, [params[j] for j in members]) for i, members in enumerate(groups)]
        self._slot = {}
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                self._slot[p] = (bucket, slot)
                bucket.bind(slot)
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._reset()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next synced step reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _reset(self) -> None:
        self._executor.reset()
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.seen.clear()

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket, slot = self._slot[p]
        self.copies += bucket.bind(slot)
        if not self._sync:
            return
        if slot in bucket.seen:
            raise RuntimeError("a second backward ran before sync_gradients(); accumulate "
                               "micro-batches inside `with engine.no_sync():`")
        bucket.seen.add(slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._ready(bucket)

    def _ready(self, bucket: Bucket) -> None:
        self._executor.mark_ready(CommTask(bucket.index, bucket.nbytes, launch=lambda: self._launch(bucket)))

    def _launch(self, bucket: Bucket):
        self.stats.bytes += bucket.nbytes
        self.stats.calls += 1
        if self.world_size == 1:
            return _Done
        if self._thread is None:
            return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        return self._thread.submit(lambda: all_reduce(bucket.buffer, algorithm=self.algorithm,
                                                      group=self.group))

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After backward: reduce whatever is not in flight yet, wait for all, average."""
        for bucket in self.buckets:
            if bucket.pending:  # parameters that got no gradient this step contribute zeros
                for slot in range(len(bucket.params)):
                    if slot not in bucket.seen:
                        bucket.bind(slot)
                bucket.pending = 0
                self._ready(bucket)
        start = time.perf_counter()
        self._executor.wait_all(len(self.buckets))
        self.stats.seconds += time.perf_counter() - start  # time not hidden behind backward
        if self.world_size > 1:
            for bucket in self.buckets:
                bucket.buffer.div_(self.world_size)
        self._reset()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None


class _DoneHandle:
    @staticmethod
    def wait() -> None:
        return None


_Done = _DoneHandle()
