"""Failure handling inside a rank: a peer that stops answering, and runs of non-finite steps.

A collective whose peer hangs or dies fails after `comm.timeout_s` (the process group's
timeout). The ranks that see it then check in at the store the process group was made with and
wait briefly for each other: whoever never checks in is the rank that stopped answering, and the
error names it with the step and the operation.
"""

from __future__ import annotations

import time

import torch.distributed as dist

CHECK_IN_SECONDS = 3.0  # how long a failed rank waits for the other survivors to check in


class PeerFailure(RuntimeError):
    """Another rank stopped answering (hung or died) while this one waited for it."""


class TooManyBadSteps(RuntimeError):
    """guard.max_bad_steps steps in a row had non-finite gradients; `from_the_start`: every step this
    process ran was one of them, so a restart from the same checkpoint would meet them again."""

    def __init__(self, message: str, *, from_the_start: bool = False) -> None:
        super().__init__(message)
        self.from_the_start = from_the_start


def is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because a peer went away or timed out."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("timed out", "timeout", "connection reset", "connection closed",
                                  "connection refused", "broken pipe", "gloo", "nccl", "peer"))


def silent_ranks(rank: int, world: int, step: int, wait_s: float = CHECK_IN_SECONDS) -> list[int]:
    """Check in as failed at `step` and return the ranks that do not check in within `wait_s`."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"paraloom/failed/{rank}", str(step))
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in range(world) if r != rank and not store.check([f"paraloom/failed/{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.1)
    except Exception:  # the store itself is gone: nothing more to learn
        return []


def peer_failure(exc: BaseException, *, rank: int, world: int, step: int, operation: str,
                 timeout_s: float) -> PeerFailure:
    """The error a rank raises when `operation` of 1-based `step` failed for want of a peer."""
    silent = silent_ranks(rank, world, step)
    who = (f"rank {silent[0]}" if len(silent) == 1 else
           f"ranks {', '.join(map(str, silent))}" if silent else "a peer")
    cause = " ".join(str(exc).split())[:200]
    # a peer that died closes its connections at once; only a hung one makes the wait run out
    timed_out = any(word in cause.lower() for word in ("timed out", "timeout"))
    when = f"after comm.timeout_s={timeout_s:g} s" if timed_out else "when its connection to them failed"
    return PeerFailure(f"{who} stopped answering (hung or died): rank {rank} gave up on the {operation} "
                       f"of step {step} {when} ({cause})")
