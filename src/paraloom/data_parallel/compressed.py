"""Compressed gradient collectives for DataParallel: compress a piece, move the payload, decode on wait.

A summable payload (fp16, bf16, random-k) is all-reduced and the sum decoded; any other payload
is all-gathered, every rank's payload decoded with this rank's context and the results summed.
Either way the decoded *sum* is written back into the gradient piece, so the sync mode's
division by the world size averages it as for uncompressed gradients. The payload's bytes are
what the comm stats count. Launching is asynchronous like the uncompressed path: decoding
happens in `wait()`, on the thread that waits (the training loop), never in a callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from paraloom.comm.algorithms import all_gather, all_reduce

# torch 2.13 renamed the flat collective; older releases (>= 2.4) have only the second name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def decode_sum(compressor, rows: torch.Tensor, ctx, out: torch.Tensor) -> None:
    """Write the sum of the decoded payloads in `rows` (ranks x payload bytes) into `out`."""
    if hasattr(compressor, "decompress_sum"):  # sparse payloads: one scatter for all ranks
        compressor.decompress_sum(rows, ctx, out)
        return
    out.copy_(compressor.decompress(rows[0], ctx).view_as(out))
    for row in rows[1:]:  # in rank order on every rank, so every rank gets the same sum
        out.add_(compressor.decompress(row, ctx).view_as(out))


class CompressedWork:
    """A launched compressed collective: `wait()` waits, then runs `finish` (decode and write the sum into
    the piece; PowerSGD: its second round too) once."""

    def __init__(self, work, finish: Callable[[], None]) -> None:
        self.work = work
        self._finish = finish
        self._done = False
        if hasattr(work, "get_future"):  # lets the priority issuer hear of completion
            self.get_future = work.get_future

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        if not self._done:
            self.work.wait()
            self._finish()
            self._done = True


def launch_compressed(engine, piece, on_done=None) -> CompressedWork:
    compressor, group, world = engine.compressor, engine.comm_group, engine.world_size
    if hasattr(compressor, "reduce"):  # a multi-round reducer (PowerSGD) runs its own rounds
        return compressor.reduce(engine, piece, on_done)
    grad, stats = piece.grad, engine.stats
    began = time.perf_counter()
    payload, ctx = compressor.compress(grad, piece.key)
    stats.encode_seconds += time.perf_counter() - began
    nbytes = payload.numel() * payload.element_size()
    name = engine.piece_name(piece) + f" ({compressor.name})"
    if compressor.summable:
        work = engine.run_async(name, nbytes,
                                lambda: dist.all_reduce(payload, group=group, async_op=True),
                                lambda: all_reduce(payload, algorithm=engine.algorithm, group=group), on_done)

        def finish() -> None:
            began = time.perf_counter()
            if hasattr(compressor, "decompress_into"):  # casts: straight into the piece
                compressor.decompress_into(payload, ctx, grad)
            else:
                grad.copy_(compressor.decompress(payload, ctx).view_as(grad))
            stats.decode_seconds += time.perf_counter() - began
    else:
        gathered = payload.new_empty(world * payload.numel())

        def blocking() -> None:
            gathered.view(world, -1)[engine.rank].copy_(payload)
            all_gather(gathered, algorithm="ring", group=group)

        work = engine.run_async(name, nbytes,
                                lambda: _all_gather_flat(gathered, payload, group=group, async_op=True),
                                blocking, on_done)

        def finish() -> None:
            began = time.perf_counter()
            decode_sum(compressor, gathered.view(world, -1), ctx, grad)
            stats.decode_seconds += time.perf_counter() - began
    return CompressedWork(work, finish)
