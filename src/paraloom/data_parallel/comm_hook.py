"""DDP communication hooks in the engine: `hook(state, bucket) -> Future[Tensor]` averages each bucket.

The engine hands a hook the same kind of bucket DDP does (`buffer()`, `index()`, `is_last()`,
`gradients()`, `parameters()`, `set_buffer()`), one call per bucket in one order on every rank,
so torch's own hooks (`default_hooks.allreduce_hook`, `fp16_compress_hook`) and paraloom's
(`paraloom.compress.ddp_hook`) run unchanged. As in DDP the hook's result is the *average*;
the engine writes it into the bucket and does not divide again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class HookBucket:
    """One engine bucket as DDP's `GradBucket` presents it to a communication hook."""

    def __init__(self, bucket, index: int, last: bool) -> None:
        self._bucket, self._index, self._last = bucket, index, last

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)


class HookHandle:
    """Completion of one hooked bucket: waiting writes the hook's average into the bucket."""

    def __init__(self, future: torch.futures.Future, buffer: torch.Tensor,
                 on_done: Callable[[], None] | None) -> None:
        self.future, self.buffer, self.on_done = future, buffer, on_done

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        result = self.future.wait()
        if isinstance(result, (list, tuple)):
            result = result[0]
        if result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result)
        if self.on_done is not None:
            self.on_done()
            self.on_done = None


def launch_hooked(engine, piece, on_done: Callable[[], None] | None = None) -> HookHandle:
    """Run the engine's registered hook on `piece`'s bucket (a whole bucket: no priority cuts)."""
    state, hook = engine.comm_hook
    bucket = piece.bucket
    future = hook(state, HookBucket(bucket, bucket.index, bucket.index == len(engine.buckets) - 1))
    engine.stats.bytes += bucket.nbytes
    engine.stats.calls += 1
    return HookHandle(future, bucket.buffer, on_done)


def check_hook(engine, hook: Any) -> None:
    """The engine settings a hook can replace the averaging of: one whole bucket per collective."""
    if engine.comm_hook is not None:
        raise RuntimeError("register_comm_hook can be called only once, as with DDP")
    if not callable(hook):
        raise TypeError(f"hook must be callable as hook(state, bucket) -> Future, got {type(hook).__name__}")
    if not engine.updater.plain_optimizer_step or engine.compressor is not None:
        raise ValueError("a communication hook replaces plain synchronous averaging: it cannot run beside "
                         "scheduler='priority', sync='one_step_delay'/'local_sgd', shard_optimizer or "
                         "compressor=; use paraloom's compressor= or the hook, not both")
    if engine.algorithm != "native":
        raise ValueError(f"a communication hook issues its own collectives; algorithm={engine.algorithm!r} "
                         "would not run: leave algorithm='native'")
    if engine.backward_started:
        raise RuntimeError("register_comm_hook must come before the first backward, as with DDP")
