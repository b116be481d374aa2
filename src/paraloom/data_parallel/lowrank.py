"""PowerSGD as DataParallel's reducer: per piece, one all-reduce of P (and the plain rest), one of Q.

A piece is a slice of a bucket, so it may hold several layers and, under the priority
scheduler, parts of one. Every layer of 2+ dimensions contributes the full rows of it that lie
in the piece as one matrix (rows of a row-major matrix are a matrix; conv kernels are viewed as
(out_channels, rest)); PowerSGD compresses the matrices where rank r makes them smaller
(Vogels et al. 2019). Biases, partial rows, and everything before `start_iter` launches of a
piece travel plainly in the first all-reduce, concatenated with the P matrices.

The Q all-reduce depends on the summed P, so it is launched in `wait()`, on the waiting thread,
never in a callback. Waits come in one order on every rank (the executor waits in launch order;
the priority updater waits module by module), so the Q all-reduces are issued in one order too.
Under the priority scheduler, whose issuing thread launches first rounds concurrently, the Q
all-reduces go to a process group of their own so the two streams never interleave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from paraloom.comm.algorithms import all_reduce
from paraloom.compress.powersgd import PowerSGDState
from paraloom.data_parallel.compressed import CompressedWork


@dataclass(frozen=True)
class Segment:
    """[start, stop) of a piece's gradient; rows > 0: a (rows, (stop - start) // rows) matrix."""

    start: int
    stop: int
    rows: int = 0


def piece_segments(piece) -> list[Segment]:
    """The piece cut into matrices (full rows of 2+-dimensional parameters) and plain runs."""
    bucket, out = piece.bucket, []
    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
        lo, hi = max(piece.start, offset), min(piece.stop, offset + p.numel())
        if lo >= hi:
            continue
        if p.dim() < 2:
            out.append(Segment(lo - piece.start, hi - piece.start))
            continue
        cols = p.numel() // p.shape[0]
        first = offset + -(-(lo - offset) // cols) * cols  # first full row boundary at or after lo
        last = offset + (hi - offset) // cols * cols  # last full row boundary at or before hi
        if last - first >= cols:
            for a, b, rows in ((lo, first, 0), (first, last, (last - first) // cols), (last, hi, 0)):
                if b > a:
                    out.append(Segment(a - piece.start, b - piece.start, rows))
        else:
            out.append(Segment(lo - piece.start, hi - piece.start))
    return out


class PowerSGDReducer:
    """comm.compressor=powersgd: the engine hands every piece to `reduce`; see the module docstring."""

    name = "powersgd"
    summable = True  # the payloads are summed (all-reduced)
    state_fields = ("state", "launches")

    def __init__(self, rank: int = 2, start_iter: int = 10, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 0) -> None:
        self.state = PowerSGDState(rank=rank, start_iter=start_iter, warm_start=warm_start,
                                   error_feedback=error_feedback, seed=seed)
        self.segments: dict[int, list[Segment]] = {}
        self.launches: dict[int, int] = {}
        self.second_group: dist.ProcessGroup | None = None  # set by the engine under priority

    def matrices(self, piece, count: int) -> list[tuple[int, Segment]]:
        """(state key, segment) of the segments compressed at this piece's launch number `count`."""
        if count < self.state.start_iter:
            return []
        segments = self.segments.get(piece.key)
        if segments is None:
            segments = self.segments[piece.key] = piece_segments(piece)
        r = self.state.rank
        return [((piece.key << 20) | j, s) for j, s in enumerate(segments)
                if s.rows and r * (s.rows + (s.stop - s.start) // s.rows) < s.stop - s.start]

    def reduce(self, engine, piece, on_done=None) -> CompressedWork:
        count = self.launches.get(piece.key, 0)
        self.launches[piece.key] = count + 1
        grad = piece.grad
        chosen = self.matrices(piece, count)
        if not chosen:  # plain all-reduce of the whole piece, in place
            work = engine.all_reduce_async(grad, engine.piece_name(piece), on_done)
            return CompressedWork(work, lambda: None)
        plain = []
        for segment in self.segments[piece.key]:
            if not (segment.rows and any(s is segment for _, s in chosen)):
                plain.append(grad[segment.start: segment.stop])
        p_parts = []
        for key, s in chosen:
            p_parts.append(self.state.p_matrices(key, grad[s.start: s.stop].view(s.rows, -1)).reshape(-1))
        edges = sum(t.numel() for t in plain)
        first = torch.cat([*(t.to(torch.float32) for t in plain), *p_parts])
        name = engine.piece_name(piece) + " (powersgd P)"
        work = _all_reduce(engine, first, engine.comm_group, name, on_done)
        return CompressedWork(work, _Pending(self, engine, piece, chosen, plain, first, edges).finish)


class _Pending:
    """What a launched first round needs to run the second and decode."""

    def __init__(self, reducer, engine, piece, chosen, plain, first, edges) -> None:
        self.reducer, self.engine, self.piece, self.chosen = reducer, engine, piece, chosen
        self.plain, self.first, self.edges = plain, first, edges

    def finish(self) -> None:
        state, grad, first = self.reducer.state, self.piece.grad, self.first
        offset = self.edges
        q_parts, shapes = [], []
        for key, s in self.chosen:
            r = state.rank_for((s.rows, (s.stop - s.start) // s.rows))
            p_summed = first[offset: offset + s.rows * r].view(s.rows, r)
            offset += s.rows * r
            q_parts.append(state.q_matrices(key, p_summed).reshape(-1))
            shapes.append(r)
        second = torch.cat(q_parts)
        group = self.reducer.second_group or self.engine.comm_group
        name = self.engine.piece_name(self.piece) + " (powersgd Q)"
        _all_reduce(self.engine, second, group, name, None).wait()
        offset = 0
        for (key, s), r in zip(self.chosen, shapes, strict=True):
            cols = (s.stop - s.start) // s.rows
            q_summed = second[offset: offset + cols * r].view(cols, r)
            offset += cols * r
            state.decompress(key, q_summed, out=grad[s.start: s.stop])
        offset = 0
        for view in self.plain:  # the summed plain values back into their places
            view.copy_(first[offset: offset + view.numel()])
            offset += view.numel()


def _all_reduce(engine, tensor: torch.Tensor, group, name: str, on_done):
    return engine.run_async(name, tensor.numel() * tensor.element_size(),
                            lambda: dist.all_reduce(tensor, group=group, async_op=True),
                            lambda: all_reduce(tensor, algorithm=engine.algorithm, group=group), on_done)
