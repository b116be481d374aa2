"""Point-to-point plumbing for hand-written collectives: group ranks, tags, segmented exchanges."""

from __future__ import annotations

import torch
import torch.distributed as dist

SEGMENT_BYTES = 1 << 20  # messages are cut into pieces of this size so reduction overlaps receiving


class Peers:
    """A process group seen by one rank: its rank, size, and sends/receives by group rank.

    gloo moves host memory only: under it a CUDA tensor is sent from a host copy and received into
    one, then copied to the device when the receive is waited for (slow, but correct; NCCL, or a
    group that gives CUDA tensors to NCCL, moves them directly)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        whole = group is None or group == dist.group.WORLD
        self._global = list(range(self.size)) if whole else [
            dist.get_global_rank(group, i) for i in range(self.size)]
        self._by_host = through_host(group)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        if self._by_host and tensor.device.type != "cpu":
            tensor = tensor.cpu()  # the work holds the copy until it is sent
        return dist.isend(tensor, dst=self._global[peer], group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work | LandsOnWait:
        if self._by_host and tensor.device.type != "cpu":
            host = torch.empty_like(tensor, device="cpu")
            work = dist.irecv(host, src=self._global[peer], group=self.group, tag=tag)
            return LandsOnWait(work, host, tensor)
        return dist.irecv(tensor, src=self._global[peer], group=self.group, tag=tag)


def through_host(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` sends a device tensor by way of host memory (plain gloo)."""
    return dist.get_backend(group) == dist.Backend.GLOO


class LandsOnWait:
    """A receive into host memory whose data is copied to its device tensor when first waited for."""

    def __init__(self, work: dist.Work, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self, *args) -> bool:
        done = self.work.wait(*args)
        if self.host is not None:
            self.target.copy_(self.host)
            self.host = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


def send_blocking(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """`dist.send`, by way of host memory where the group needs it (see `Peers`)."""
    if through_host(group) and tensor.device.type != "cpu":
        tensor = tensor.cpu()
    dist.send(tensor, dst, group=group)


def recv_blocking(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """`dist.recv` into `tensor`, by way of host memory where the group needs it (see `Peers`)."""
    if through_host(group) and tensor.device.type != "cpu":
        host = torch.empty_like(tensor, device="cpu")
        dist.recv(host, src, group=group)
        tensor.copy_(host)
    else:
        dist.recv(tensor, src, group=group)


def segment_elems(tensor: torch.Tensor, segment_bytes: int = SEGMENT_BYTES) -> int:
    return max(1, segment_bytes // tensor.element_size())


def pieces(tensor: torch.Tensor, elems: int) -> tuple[torch.Tensor, ...]:
    """Split a 1-D tensor into pieces of `elems`; an empty tensor has no pieces (sends nothing)."""
    return tensor.split(elems) if tensor.numel() else ()


def send(peers: Peers, tensor: torch.Tensor, peer: int, tag: int, elems: int) -> list[dist.Work]:
    """Post a segmented send; the caller waits on the returned handles."""
    return [peers.isend(p, peer, tag + i) for i, p in enumerate(pieces(tensor, elems))]


def post_recv(peers: Peers, out: torch.Tensor, peer: int, tag: int, elems: int,
              scratch: torch.Tensor | None = None) -> list[tuple[dist.Work, torch.Tensor, torch.Tensor]]:
    """Post the receives of `out` (into `scratch` when the data is to be added); finish with `finish`."""
    targets = pieces(scratch[: out.numel()] if scratch is not None else out, elems)
    return [(peers.irecv(t, peer, tag + i), piece, t)
            for i, (piece, t) in enumerate(zip(pieces(out, elems), targets, strict=True))]


def finish(posted: list[tuple[dist.Work, torch.Tensor, torch.Tensor]]) -> None:
    """Wait for posted receives in order, adding each scratch piece into its target as it lands."""
    for handle, piece, got in posted:
        handle.wait()
        if got.data_ptr() != piece.data_ptr():
            piece.add_(got)


def recv(peers: Peers, out: torch.Tensor, peer: int, tag: int, elems: int,
         scratch: torch.Tensor | None = None) -> None:
    """Receive `out` from `peer`; with `scratch`, add what arrives into `out` piece by piece."""
    finish(post_recv(peers, out, peer, tag, elems, scratch))


def exchange(peers: Peers, outgoing: torch.Tensor, incoming: torch.Tensor, peer: int, tag: int,
             elems: int, scratch: torch.Tensor | None = None) -> None:
    """Send `outgoing` to `peer` while receiving `incoming` from it (added in, with `scratch`)."""
    posted = post_recv(peers, incoming, peer, tag, elems, scratch)  # receives first: never stall
    sends = send(peers, outgoing, peer, tag, elems)
    finish(posted)
    for handle in sends:
        handle.wait()
