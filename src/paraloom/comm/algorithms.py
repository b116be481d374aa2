"""All-reduce as transparent algorithms on point-to-point messages, beside the backend's own.

- ring: reduce-scatter then all-gather around a ring, 2(n-1) steps of S/n each; every block is
  cut into segments and each segment is reduced and forwarded the moment it arrives, so the
  steps pipeline (Patarasuk & Yuan 2009; the NCCL/Horovod ring).
- halving_doubling: recursive vector halving reduce-scatter, then recursive doubling
  all-gather, log2(p) steps each; a size n that is not a power of two first folds the first
  2(n - p) ranks pairwise into p (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).
- tree: binomial-tree reduce to rank 0, then binomial-tree broadcast, 2 log2(n) steps of S.
- one_to_all: every rank sends to rank 0, which reduces and sends the result back (the traffic
  pattern of a single parameter server).
- native: the backend's own all-reduce (gloo or NCCL), except where gloo sums slowly: a CPU
  float16 tensor of `HALF_RING_BYTES` or more goes around paraloom's ring instead. gloo adds
  float16 element by element through float conversions, without vector instructions: on this
  project's 2-core host its all-reduce of 4M float16 elements took as long as of 4M float32
  (16.1 against 17.0 ms on 2 processes, 49.6 against 52.4 on 4) for half the bytes, where the
  ring, summing with torch's vectorized kernels, took 9.4 and 39.4 ms (`benchmarks/half_sums.py`;
  BENCHMARKS.md, "fp16 payloads at 10 Gbit/s"). bfloat16 gloo sums fast: it stays on gloo.

Every function works in place on any tensor (any shape, size 0 and 1 included) and on any
process group, and issues its messages in an order every rank derives from (rank, size) alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from paraloom.comm.p2p import Peers, exchange, pieces, recv, segment_elems, send
from paraloom.config.choices import ALL_REDUCE_ALGORITHMS, SHARDABLE_ALGORITHMS
from paraloom.config.rules import check_name

TAG_STRIDE = 1 << 16
RING_LOOKAHEAD = 1
HALF_RING_BYTES = 1 << 20  # at 256 KB and below gloo's fewer messages won or tied (4 processes)

_SUM, _AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(like: torch.Tensor, count: int) -> torch.Tensor:
    """Receive buffers kept between calls: fresh pages would fault in the middle of every transfer.

    Calls are blocking and issued from one thread (DESIGN.md §3), so they never share a buffer
    while it is in use; the cache holds the largest buffers seen, per dtype and device.
    """
    key = (like.dtype, like.device, count)
    buf = _SCRATCH.get(key)
    if buf is None or buf.shape[1] < like.numel():
        buf = _SCRATCH[key] = torch.empty(count, like.numel(), dtype=like.dtype, device=like.device)
    return buf[:, : like.numel()]


def _check_pieces(tensor: torch.Tensor, elems: int) -> None:
    if tensor.numel() > elems * TAG_STRIDE:
        raise ValueError(f"tensor of {tensor.numel()} elements needs more than {TAG_STRIDE} "
                         "segments; raise segment_bytes")


def ring(flat: torch.Tensor, peers: Peers, *, reduce_scatter: bool = True, all_gather: bool = True,
         elems: int | None = None) -> None:
    """Ring reduce-scatter and/or all-gather on a flat tensor's `tensor_split(n)` blocks.

    After the reduce-scatter rank r holds the sum of block r; the all-gather starts from each
    rank's own block r. Step s sends block (r-1-s) and receives block (r-2-s) (reduce-scatter),
    then block (r-t) out and (r-1-t) in (all-gather step t): what arrives at one step is
    exactly what leaves at the next, so it is forwarded segment by segment.
    """
    n, r = peers.size, peers.rank
    if n == 1 or flat.numel() == 0:
        return
    elems = elems or segment_elems(flat)
    _check_pieces(flat, elems)
    blocks = flat.tensor_split(n)
    right, left = (r + 1) % n, (r - 1) % n
    rs_steps = n - 1 if reduce_scatter else 0
    total = rs_steps + (n - 1 if all_gather else 0)
    if total == 0:
        return

    def sent_block(step: int) -> int:
        return (r - 1 - step) % n if step < rs_steps else (r - (step - rs_steps)) % n

    def received_block(step: int) -> int:
        return (r - 2 - step) % n if step < rs_steps else (r - 1 - (step - rs_steps)) % n

    ahead = RING_LOOKAHEAD  # steps whose receives are posted before the current one is drained
    scratch = list(_scratch(blocks[0], ahead + 1).unbind()) if rs_steps else []

    def post_recvs(step: int) -> list[tuple[dist.Work, torch.Tensor, torch.Tensor | None]]:
        block = blocks[received_block(step)]
        if step < rs_steps:  # into scratch, to be added; step s+ahead reuses step s-1's buffer
            buf = scratch[step % (ahead + 1)][: block.numel()]
            return [(peers.irecv(b, left, step * TAG_STRIDE + i), p, b)
                    for i, (p, b) in enumerate(zip(pieces(block, elems), pieces(buf, elems), strict=True))]
        return [(peers.irecv(p, left, step * TAG_STRIDE + i), p, None)
                for i, p in enumerate(pieces(block, elems))]

    # receives before sends: gloo stalls on data that no posted receive waits for
    posted = [post_recvs(step) for step in range(min(ahead, total))]
    sends = [peers.isend(p, right, i) for i, p in enumerate(pieces(blocks[sent_block(0)], elems))]
    for step in range(total):
        if step + ahead < total:
            posted.append(post_recvs(step + ahead))
        for i, (handle, piece, buf) in enumerate(posted[step]):
            handle.wait()
            if buf is not None:
                piece.add_(buf)
            if step + 1 < total:  # this piece is part of the block the next step sends
                sends.append(peers.isend(piece, right, (step + 1) * TAG_STRIDE + i))
        posted[step] = []
    for handle in sends:
        handle.wait()


def halving_doubling(flat: torch.Tensor, peers: Peers, *, elems: int | None = None) -> None:
    n, r = peers.size, peers.rank
    if n == 1 or flat.numel() == 0:
        return
    elems = elems or segment_elems(flat)
    _check_pieces(flat, elems)
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p
    scratch = _scratch(flat, 1)[0]
    tag = 0
    if r < 2 * extra:  # fold: even ranks hand their vector to the odd neighbour and wait
        if r % 2 == 0:
            for handle in send(peers, flat, r + 1, tag, elems):
                handle.wait()
            recv(peers, flat, r + 1, TAG_STRIDE * 63, elems)
            return
        recv(peers, flat, r - 1, tag, elems, scratch)
        v = r // 2
    else:
        v = r - extra

    def real(virtual: int) -> int:
        return 2 * virtual + 1 if virtual < extra else virtual + extra

    sizes = [b.numel() for b in flat.tensor_split(p)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)

    def span(lo: int, hi: int) -> torch.Tensor:
        return flat[bounds[lo]:bounds[hi]]

    lo, hi, d = 0, p, p // 2
    while d >= 1:  # recursive halving: keep the half named by this bit, send the other
        tag += TAG_STRIDE
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        exchange(peers, span(*give), span(*keep), real(v ^ d), tag, elems, scratch)
        (lo, hi), d = keep, d // 2
    d = 1
    while d < p:  # recursive doubling: swap ranges with the partner, doubling what is held
        tag += TAG_STRIDE
        width = hi - lo
        theirs = (lo - width, lo) if v & d else (hi, hi + width)
        exchange(peers, span(lo, hi), span(*theirs), real(v ^ d), tag, elems)
        lo, hi, d = min(lo, theirs[0]), max(hi, theirs[1]), d * 2
    if r < 2 * extra:  # unfold: give the result back to the even neighbour
        for handle in send(peers, flat, r - 1, TAG_STRIDE * 63, elems):
            handle.wait()


def tree(flat: torch.Tensor, peers: Peers, *, elems: int | None = None) -> None:
    n, r = peers.size, peers.rank
    if n == 1 or flat.numel() == 0:
        return
    elems = elems or segment_elems(flat)
    _check_pieces(flat, elems)
    scratch = _scratch(flat, 1)[0]
    mask = 1
    while mask < n:  # reduce: at level k a rank with bit k set sends to its parent and is done
        if r & mask:
            for handle in send(peers, flat, r - mask, 0, elems):
                handle.wait()
            break
        if r + mask < n:
            recv(peers, flat, r + mask, 0, elems, scratch)
        mask <<= 1
    if r:  # broadcast: the parent is r with its lowest set bit cleared
        recv(peers, flat, r - (r & -r), TAG_STRIDE, elems)
    mask = (r & -r) >> 1 if r else 1 << (n - 1).bit_length() >> 1
    handles = []
    while mask >= 1:
        if r + mask < n:
            handles += send(peers, flat, r + mask, TAG_STRIDE, elems)
        mask >>= 1
    for handle in handles:
        handle.wait()


def one_to_all(flat: torch.Tensor, peers: Peers, *, elems: int | None = None) -> None:
    n, r = peers.size, peers.rank
    if n == 1 or flat.numel() == 0:
        return
    elems = elems or segment_elems(flat)
    _check_pieces(flat, elems)
    if r:
        for handle in send(peers, flat, 0, 0, elems):
            handle.wait()
        recv(peers, flat, 0, TAG_STRIDE, elems)
        return
    scratch = _scratch(flat, 1)[0]
    for peer in range(1, n):
        recv(peers, flat, peer, 0, elems, scratch)
    handles = [h for peer in range(1, n) for h in send(peers, flat, peer, TAG_STRIDE, elems)]
    for handle in handles:
        handle.wait()


ALGORITHMS: dict[str, Callable[..., None]] = {
    "ring": ring, "halving_doubling": halving_doubling, "tree": tree, "one_to_all": one_to_all,
}


def check_algorithm(name: str, allowed: tuple[str, ...] = ALL_REDUCE_ALGORITHMS) -> None:
    check_name("comm.algorithm", name, allowed)


def _average(tensor: torch.Tensor, n: int) -> None:
    if n == 1:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:  # integers round toward zero, as NCCL's average does
        tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))


def _flat_workspace(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def _gloo_sums_slowly(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether the backend's all-reduce of `tensor` is gloo's float16 sum (module docstring)."""
    return (tensor.dtype == torch.float16 and tensor.device.type == "cpu"
            and tensor.numel() * 2 >= HALF_RING_BYTES and "gloo" in str(dist.get_backend(group)))


def all_reduce(tensor: torch.Tensor, *, algorithm: str = "native",
               op: dist.ReduceOp.RedOpType = _SUM, group: dist.ProcessGroup | None = None,
               segment_bytes: int | None = None) -> torch.Tensor:
    """In-place all-reduce (SUM or AVG) of `tensor` over `group` with the named algorithm."""
    check_algorithm(algorithm)
    if op not in (_SUM, _AVG):
        raise ValueError("only ReduceOp.SUM and ReduceOp.AVG are supported")
    peers = Peers(group)
    if algorithm == "native" and _gloo_sums_slowly(tensor, group):
        algorithm = "ring"
    if algorithm == "native":
        dist.all_reduce(tensor, op=_SUM, group=group)  # gloo has no AVG: divide below
    else:
        flat = _flat_workspace(tensor)
        elems = segment_elems(flat, segment_bytes) if segment_bytes else None
        ALGORITHMS[algorithm](flat, peers, elems=elems)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    if op == _AVG:
        _average(tensor, peers.size)
    return tensor


def block_of(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s block of a flat tensor: the `tensor_split(size)` partition."""
    return tensor.view(-1).tensor_split(size)[rank]


# torch 2.13 renamed the flat collectives; older releases (>= 2.4) have only the first names
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _padded(flat: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A (n * width) copy of `flat` whose row i is block i zero-padded to the widest block."""
    width = -(-flat.numel() // n)
    rows = flat.new_zeros(n, width)
    for i, block in enumerate(flat.tensor_split(n)):
        rows[i, : block.numel()] = block
    return rows.view(-1), width


def reduce_scatter(tensor: torch.Tensor, *, algorithm: str = "ring",
                   op: dist.ReduceOp.RedOpType = _SUM,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce a contiguous tensor; return this rank's block (a view of `tensor`, which it clobbers)."""
    check_algorithm(algorithm, SHARDABLE_ALGORITHMS)
    peers = Peers(group)
    flat = tensor.view(-1)
    mine = block_of(flat, peers.rank, peers.size)
    if algorithm == "ring":
        ring(flat, peers, all_gather=False)
    elif peers.size > 1 and flat.numel():
        padded, width = _padded(flat, peers.size)
        out = flat.new_empty(width)
        _reduce_scatter_flat(out, padded, group=group)
        mine.copy_(out[: mine.numel()])
    if op == _AVG:
        _average(mine, peers.size)
    return mine


def all_gather(tensor: torch.Tensor, *, algorithm: str = "ring",
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Fill every rank's block of a contiguous tensor from the rank that holds it, in place."""
    check_algorithm(algorithm, SHARDABLE_ALGORITHMS)
    peers = Peers(group)
    flat = tensor.view(-1)
    if algorithm == "ring":
        ring(flat, peers, reduce_scatter=False)
    elif peers.size > 1 and flat.numel():
        width = -(-flat.numel() // peers.size)
        mine = flat.new_zeros(width)
        own = block_of(flat, peers.rank, peers.size)
        mine[: own.numel()] = own
        rows = flat.new_empty(peers.size * width)
        _all_gather_flat(rows, mine, group=group)
        for i, block in enumerate(flat.tensor_split(peers.size)):
            block.copy_(rows[i * width: i * width + block.numel()])
    return tensor
