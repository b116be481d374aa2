"""Timed, device-agnostic collective wrappers that count the bytes each rank hands over."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paraloom.comm import algorithms


@dataclass
class CommStats:
    """Running totals for one rank: payload bytes given to collectives, calls, seconds spent."""

    bytes: int = 0  # tensor bytes passed to collectives (payload, not the algorithm's wire traffic)
    calls: int = 0
    seconds: float = 0.0  # wall time inside blocking collectives
    encode_seconds: float = 0.0  # compressing gradients (during backward)
    decode_seconds: float = 0.0  # decompressing them (while waiting: a part of `seconds`)

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.calls += 1
        self.seconds += seconds

    def take(self) -> CommStats:
        """Return the totals so far and start again from zero."""
        out = CommStats(self.bytes, self.calls, self.seconds, self.encode_seconds, self.decode_seconds)
        self.bytes, self.calls, self.seconds, self.encode_seconds, self.decode_seconds = 0, 0, 0.0, 0.0, 0.0
        return out


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, algorithm: str = "native",
               stats: CommStats | None = None) -> torch.Tensor:
    """Blocking in-place all-reduce with the named algorithm, timed and counted in `stats`."""
    start = time.perf_counter()
    algorithms.all_reduce(tensor, algorithm=algorithm, op=op, group=group)
    if stats is not None:
        stats.add(nbytes(tensor), time.perf_counter() - start)
    return tensor


def broadcast(tensor: torch.Tensor, *, src_group_rank: int = 0,
              group: dist.ProcessGroup | None = None,
              stats: CommStats | None = None) -> torch.Tensor:
    """Blocking in-place broadcast from the group's rank `src_group_rank`, timed and counted."""
    src = dist.get_global_rank(group or dist.group.WORLD, src_group_rank)  # torch<2.6: no group_src
    start = time.perf_counter()
    dist.broadcast(tensor, src=src, group=group)
    if stats is not None:
        stats.add(nbytes(tensor), time.perf_counter() - start)
    return tensor


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, src: int = 0) -> None:
    """Group rank `src`'s values into `tensors` on every rank: one broadcast per dtype and device
    (the tensors flattened into one buffer, copied back without a host synchronisation)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        broadcast(flat, src_group_rank=src, group=group)
        for tensor, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
            tensor.copy_(part.view_as(tensor))


def default_timeout() -> timedelta | None:
    """The default process group's timeout, for the groups made after it.

    `dist.new_group` does not inherit it (it falls back to 30 minutes), so a collective on a later
    group would wait half an hour for a hung peer; None when the backend does not say.
    """
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


def private_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group over the same ranks as `group`, which must span the whole world.

    Making a group is collective over the world, so a sub-group's private twin must be made by
    the caller on every rank (and passed as `comm_group`).
    """
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if len(ranks) != dist.get_world_size():
        raise ValueError("scheduler='priority' on a sub-group needs comm_group=: a second group over the "
                         "same ranks, made on every rank with dist.new_group")
    return dist.new_group(ranks=ranks, timeout=default_timeout())


class ThenOnWait:
    """A work whose callbacks run when it is first waited for (a work without a future)."""

    def __init__(self, work: dist.Work, then: Callable[[], None]) -> None:
        self.work, self.then = work, then

    def wait(self, *args) -> bool:
        done = self.work.wait(*args)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()
