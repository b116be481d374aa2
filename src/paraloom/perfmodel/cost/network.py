"""Communication time of collectives, point-to-point messages and parameter-server steps (alpha-beta)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import NamedTuple, Protocol

from paraloom.config.choices import ALL_REDUCE_ALGORITHMS, MODELLED_ALGORITHMS
from paraloom.config.errors import UserError

# The alpha-beta (Hockney) model: one message of S bytes over a link costs alpha + S / B, alpha the
# latency and B the one-direction bandwidth; links are full duplex, and a collective's time is
# c_lat * alpha + c_bw * S / B with coefficients that depend on the algorithm and the group size n
# (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
# MPICH", §2 and Table 1). The coefficients below follow what paraloom's code does
# (paraloom/comm/algorithms.py), not the textbook variant where the two differ.

PS_HEADER_BYTES = 16  # parameter_server/message.py: SLOTS = 4 int32 slots at the front of every message


class LinkLike(Protocol):
    """Anything with a one-direction `bandwidth` (bytes/s) and a `latency` (s): hardware.Link."""

    bandwidth: float
    latency: float


class _Wire(NamedTuple):
    bandwidth: float
    latency: float


def _check_group(nbytes: float, n: int) -> None:
    if n < 1 or int(n) != n:
        raise UserError(f"group size n={n!r} must be a positive integer")
    if nbytes < 0:
        raise UserError(f"message size nbytes={nbytes!r} must not be negative")


def _paraloom_tree_children(r: int, n: int) -> list[int]:
    """comm/algorithms.py `tree`: rank r's broadcast children, in the order it posts the sends."""
    mask = (r & -r) >> 1 if r else 1 << (n - 1).bit_length() >> 1
    return [r + m for m in (mask >> i for i in range(mask.bit_length())) if r + m < n]


def _gloo_tree_children(v: int, n: int) -> list[int]:
    """gloo/broadcast.cc (gloo::broadcast, torch's gloo broadcast): virtual rank v's children."""
    dim = (n - 1).bit_length()
    return [v | 1 << i for i in range(dim) if v < 1 << i and v | 1 << i < n]


@lru_cache(maxsize=256)
def _binomial_broadcast(n: int, gloo: bool) -> tuple[int, int]:
    """(hops, copies) on the critical path of a binomial broadcast whose senders post every send at once.

    A rank sends to its k children concurrently, so its uplink carries k copies and (fair sharing,
    equal sizes) all k arrive after k * S / B; a child forwards only once it holds the whole
    message. The path that is longest in hops is also longest in copies for every n up to 1100
    (checked exhaustively while writing this), so one path gives both coefficients. Measured on
    4 x 1 Gbit/s (BENCHMARKS.md, tree at 16-64 MB): 5.4 S/B for the all-reduce, where this gives
    5 (2 reduce + 3 broadcast) and the textbook sequential broadcast 4.
    """
    children: Callable[[int, int], list[int]] = _gloo_tree_children if gloo else _paraloom_tree_children
    best, order, path = (0, 0), [0], {0: (0, 0)}
    for r in order:
        kids = children(r, n)
        hops, copies = path[r]
        for child in kids:
            path[child] = (hops + 1, copies + len(kids))
            best = max(best, path[child])
            order.append(child)
    return best


def allreduce_coefficients(n: int, algorithm: str = "ring") -> tuple[float, float]:
    """(c_lat, c_bw): the all-reduce of S bytes over n ranks takes c_lat * alpha + c_bw * S / B."""
    known = (*ALL_REDUCE_ALGORITHMS, *MODELLED_ALGORITHMS)
    if algorithm not in known:
        raise UserError(f"all-reduce algorithm={algorithm!r} is not known; choose one of: {', '.join(known)}")
    if n == 1:
        return 0.0, 0.0
    if algorithm.startswith("hierarchical_"):  # on one node, or one rank a node: the algorithm itself
        algorithm = algorithm.removeprefix("hierarchical_")
    if algorithm in MODELLED_ALGORITHMS:
        return _modelled_tree(n, algorithm)
    if algorithm in ("ring", "native"):
        # Ring: reduce-scatter + all-gather, 2(n-1) steps of S/n each; bandwidth-optimal
        # (Patarasuk & Yuan 2009). "native" is gloo's allreduce, whose default algorithm is a ring
        # (gloo/allreduce.h); NCCL's is ring for large messages too — modelled as the ring.
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if algorithm == "halving_doubling":
        # Rabenseifner: recursive-halving reduce-scatter + recursive-doubling all-gather over the
        # largest power of two p <= n, log2 p steps each, moving (p-1)/p S each way (Thakur et al.
        # 2005, §4.4). For n != p the code first folds 2(n-p) ranks pairwise (a full S to the odd
        # neighbour) and unfolds at the end: one more alpha + S/B each.
        p = 1 << (n.bit_length() - 1)
        fold = 0.0 if n == p else 2.0
        return 2.0 * math.log2(p) + fold, 2.0 * (p - 1) / p + fold
    if algorithm == "tree":
        # Binomial reduce to rank 0 (ceil(log2 n) levels of a full S, level by level), then a
        # binomial broadcast whose sends are posted together (see _binomial_broadcast).
        levels = (n - 1).bit_length()
        hops, copies = _binomial_broadcast(n, gloo=False)
        return float(levels + hops), float(levels + copies)
    # one_to_all: rank 0 receives the n-1 vectors one after another ((n-1)(alpha + S/B)), then
    # posts n-1 sends at once, its uplink carrying (n-1) S (alpha + (n-1) S/B): 2(n-1) copies of S
    # cross rank 0's link, as for a single parameter server.
    return float(n), 2.0 * (n - 1)


def _modelled_tree(n: int, algorithm: str) -> tuple[float, float]:
    """(c_lat, c_bw) of the trees other systems run, which paraloom prices but does not run.

    - reduction_tree: reduce the whole vector up a binary tree, then broadcast it down, level by
      level: 2 ceil(log2 n) steps of alpha + S/B. This is the tree all-reduce of Paleo (Qi, Sparks &
      Talwalkar, "Paleo: A Performance Model for Deep Neural Networks", ICLR 2017, section 3.3),
      the textbook reduce + broadcast without pipelining.
    - double_binary_tree: NCCL's trees (from NCCL 2.4; S. Jeaugey, "Massively Scale Your Deep
      Learning Training with NCCL 2.4", NVIDIA technical blog, 2019), after Sanders, Speck & Traff,
      "Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing
      35(12), 2009. Two complementary binary trees each carry half the vector, cut in chunks that are
      reduced up and broadcast down at once (pipelined). A rank is inside one tree and a leaf of the
      other, so it receives S (two children's halves) + S/2 (its parent's half back) in the first and
      S/2 in the second: 2 S/B each way, the ring's full bandwidth for large n, with a latency of
      2 ceil(log2 n) hops, the depth up and down (the pipeline's fill of one chunk per hop is left out).
    """
    depth = float((n - 1).bit_length())  # ceil(log2 n)
    if algorithm == "reduction_tree":
        return 2.0 * depth, 2.0 * depth
    return 2.0 * depth, 2.0


def allreduce_time(nbytes: float, n: int, link: LinkLike, algorithm: str = "ring") -> float:
    """Seconds to all-reduce `nbytes` over n ranks joined by `link`, with a comm.algorithm name."""
    _check_group(nbytes, n)
    c_lat, c_bw = allreduce_coefficients(n, algorithm)
    return c_lat * link.latency + c_bw * nbytes / link.bandwidth


def _check_ring_only(algorithm: str, what: str) -> None:
    if algorithm not in ("ring", "native"):
        raise UserError(f"{what} algorithm={algorithm!r} is not available; choose ring or native")


def reduce_scatter_time(nbytes: float, n: int, link: LinkLike, algorithm: str = "ring") -> float:
    """Seconds to reduce-scatter a tensor of `nbytes` (the whole input; each rank keeps nbytes/n)."""
    # The ring's first half: n-1 steps of S/n (Thakur et al. 2005, §4.6). comm.algorithms offers
    # ring and native; gloo's native reduce-scatter is modelled as the same ring.
    _check_group(nbytes, n)
    _check_ring_only(algorithm, "reduce-scatter")
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def allgather_time(nbytes: float, n: int, link: LinkLike, algorithm: str = "ring") -> float:
    """Seconds to all-gather into a tensor of `nbytes` (the whole output: n blocks of nbytes/n)."""
    # The ring's second half: n-1 steps of S/n (Thakur et al. 2005, §4.1); gloo's allgather is a
    # ring too. For n payloads of P bytes each (a non-summable compressor), pass nbytes = n * P.
    _check_group(nbytes, n)
    _check_ring_only(algorithm, "all-gather")
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def broadcast_time(nbytes: float, n: int, link: LinkLike) -> float:
    """Seconds for comm.collectives.broadcast (gloo's binomial broadcast) of `nbytes` to n ranks."""
    # gloo::broadcast posts every send of a rank at once (gloo/broadcast.cc); see _binomial_broadcast.
    _check_group(nbytes, n)
    if n == 1:
        return 0.0
    hops, copies = _binomial_broadcast(n, gloo=True)
    return hops * link.latency + copies * nbytes / link.bandwidth


def p2p_time(nbytes: float, link: LinkLike) -> float:
    """Seconds for one point-to-point message (a pipeline stage's activations or gradients): alpha + S/B."""
    _check_group(nbytes, 1)
    return link.latency + nbytes / link.bandwidth


def group_link(n_ranks: int, per_node: int, intra: LinkLike, inter: LinkLike, stride: int = 1) -> LinkLike:
    """The link a group of `n_ranks` ranks `stride` apart uses: `intra` when it fits in one node.

    Ranks are numbered node by node (per_node consecutive ranks a node, as Topology lays out tp
    innermost) and the group starts at a multiple of its span, so it stays on one node exactly
    when its span (n_ranks - 1) * stride + 1 is at most per_node. tp groups have stride 1, dp
    groups stride tp, pp neighbours stride dp * tp.
    """
    _check_group(0, n_ranks)
    _check_group(0, per_node)
    return intra if (n_ranks - 1) * stride + 1 <= per_node else inter


def hierarchical_wire(per_node: int, intra: LinkLike, inter: LinkLike, algorithm: str = "ring",
                      nics: float = 1.0) -> _Wire:
    """The one link a flat all-reduce across nodes runs at, its ranks numbered node by node with
    `per_node` of them on each node and `nics` of the node's network adapters theirs.

    Every step waits for its slowest edge, so the flat formula runs at the slower bandwidth and the
    larger latency of the two links (`intra` matters only where a node holds several of the ranks),
    with the adapters' bandwidth divided among the group's ranks that cross them at the same time:
    - ring, native, tree, one_to_all and the modelled trees: 1. A ring over consecutive ranks leaves
      each node by one edge (node i's last rank -> node i+1's first), so one adapter carries one
      rank's 2(n-1)/n S; the binomial tree's cross-node levels start from multiples of per_node, one
      rank per node; a single ring or tree is one flow and uses one adapter however many there are.
    - halving_doubling: per_node. Its long-distance steps pair every rank of a node with a rank on
      another node at once (an upper bound: its short steps stay inside the node); those flows
      spread over the group's adapters.
    Groups that run at once through the same adapters (a node's tp x pp data-parallel groups) each
    get their share: the caller passes `nics` as the node's adapters over the groups it holds.
    """
    flows = per_node if algorithm == "halving_doubling" else 1
    bandwidth = inter.bandwidth * min(1.0, nics / flows)
    if per_node > 1:
        return _Wire(min(intra.bandwidth, bandwidth), max(intra.latency, inter.latency))
    return _Wire(bandwidth, inter.latency)


def hierarchical_allreduce_time(nbytes: float, n_nodes: int, per_node: int, intra: LinkLike,
                                inter: LinkLike, algorithm: str = "ring", nics: float = 1.0) -> float:
    """Seconds for one flat all-reduce over n_nodes * per_node ranks, numbered node by node: the flat
    formula on `intra` within one node, else at `hierarchical_wire`'s link."""
    _check_group(nbytes, n_nodes)
    _check_group(nbytes, per_node)
    n = n_nodes * per_node
    if n_nodes == 1:
        return allreduce_time(nbytes, n, intra, algorithm)
    return allreduce_time(nbytes, n, hierarchical_wire(per_node, intra, inter, algorithm, nics), algorithm)


def group_allreduce_time(nbytes: float, n_nodes: int, per_node: int, intra: LinkLike, inter: LinkLike,
                         algorithm: str = "ring", nics: float = 1.0) -> float:
    """Seconds for a data-parallel group's all-reduce over n_nodes x per_node ranks: flat at
    `hierarchical_wire`'s link, or for `hierarchical_<alg>` in three phases (NCCL's and Horovod's
    hierarchical all-reduce; Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 4.1, where
    the servers' sums meet by recursive halving and doubling): a ring reduce-scatter inside each node,
    then <alg> across nodes of a 1/per_node share of the vector by each of a node's ranks at once (per_node
    flows through the `nics` adapters: with one adapter, the whole vector through it, as Goyal's one
    sum per server), then a ring all-gather inside the node. The inside phases together cost a ring
    all-reduce on `intra`."""
    if not algorithm.startswith("hierarchical_") or n_nodes == 1 or per_node == 1:
        flat = algorithm.removeprefix("hierarchical_")
        if n_nodes == 1:
            return allreduce_time(nbytes, per_node, intra, flat)
        wire = hierarchical_wire(per_node, intra, inter, flat, nics)
        return allreduce_time(nbytes, n_nodes * per_node, wire, flat)
    across = _Wire(inter.bandwidth * min(1.0, nics / per_node), inter.latency)
    inside = allreduce_time(nbytes, per_node, intra, "ring")
    between = allreduce_time(nbytes / per_node, n_nodes, across, algorithm.removeprefix("hierarchical_"))
    return inside + between


def _ps_phase(total: float, workers: int, servers: int, link: LinkLike, slices: int,
              colocated: bool) -> float:
    """Seconds for `total` bytes a worker moves to (or from) the servers, bounded by the busier NIC.
    Apart: a worker's NIC carries all of it, a server's workers * total / servers. Co-located (a
    server on each of `servers` of the workers' nodes): what a node sends its own server never
    reaches its NIC, so a server's node carries (workers - 1) / workers of its shard's traffic, and
    a worker's (servers - 1) / servers of its own, or all of it where some nodes hold no server."""
    headers = slices * PS_HEADER_BYTES
    if colocated and workers > 1:
        own = 1.0 if servers < workers else (servers - 1) / servers
        worker_nic = own * (total + servers * headers)
        server_nic = (workers - 1) * (total / servers + headers)
    else:
        worker_nic = total + servers * headers
        server_nic = workers * (total / servers + headers)
    return max(worker_nic, server_nic) / link.bandwidth


def _check_ps(nbytes: float, workers: int, servers: int, slices: int, colocated: bool) -> None:
    _check_group(nbytes, workers)
    _check_group(nbytes, servers)
    if slices < 1:
        raise UserError(f"slices={slices} must be at least 1")
    if colocated and servers > workers:
        raise UserError(f"{servers} co-located parameter servers need as many nodes of workers; "
                        f"there are {workers}")


def ps_time(nbytes: float, workers: int, servers: int, link: LinkLike,
            push_bytes: float | None = None, slices: int = 1, colocated: bool = False) -> float:
    """Seconds for one parameter-server step: every worker pushes its gradient and pulls the parameters.

    `nbytes` is the model's fp32 parameters, cut into `servers` equal shards, each sent as `slices`
    messages (`ps.partition_mb`); `push_bytes` the gradient as pushed (a compressor's payload;
    default nbytes). Each worker and each server has its own node and NIC of `link` (as in
    benchmarks/ps.py), or with `colocated` each server shares a worker's node (as TensorFlow's
    published runs placed their ps tasks). Every message carries a 16-byte header
    (parameter_server/message.py). Push: a worker's NIC sends push_bytes in all, a server's
    receives workers * push_bytes / servers; the busier NIC bounds the phase (`_ps_phase`). Pull:
    the same with nbytes in the other direction. Under BSP a server replies to a slice once every
    worker's push of it is in: with one slice the phases add (2 alpha + both phases); with k slices
    the replies of slice i flow out while slice i + 1 flows in, so the longer phase is paid whole
    and the shorter only for its last slice (2 alpha + longer + shorter / k). ASP and SSP move the
    same bytes per step; they change who waits, not the traffic.
    """
    _check_ps(nbytes, workers, servers, slices, colocated)
    push = nbytes if push_bytes is None else push_bytes
    longer, shorter = sorted((_ps_phase(push, workers, servers, link, slices, colocated),
                              _ps_phase(nbytes, workers, servers, link, slices, colocated)), reverse=True)
    return 2 * link.latency + longer + shorter / slices


def ps_pull_time(nbytes: float, workers: int, servers: int, link: LinkLike, slices: int = 1,
                 colocated: bool = False) -> float:
    """Seconds of the pull phase alone (`ps_time`'s second half): every worker reads the parameters
    back from the servers once no push is in flight any more."""
    _check_ps(nbytes, workers, servers, slices, colocated)
    return link.latency + _ps_phase(nbytes, workers, servers, link, slices, colocated)


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], n: int,
                   algorithm: str = "ring") -> tuple[float, float]:
    """(alpha, bandwidth) that best explain measured all-reduce times t = c_lat alpha + c_bw S / B.

    The model is linear in alpha and 1/B; the fit minimises the squared *relative* error, so a
    1 KB point (latency-bound) weighs as much as a 64 MB one (bandwidth-bound), as calibration
    sweeps over decades need. Both results are non-negative: a negative alpha is clamped to 0 and
    1/B refitted alone.
    """
    if len(sizes_bytes) != len(seconds):
        raise UserError(f"fit_alpha_beta got {len(sizes_bytes)} sizes but {len(seconds)} times")
    if len(set(sizes_bytes)) < 2:
        raise UserError("fit_alpha_beta needs measurements at 2 or more distinct sizes; "
                        "time a sweep such as 1KB..64MB")
    if min(seconds) <= 0 or min(sizes_bytes) < 0:
        raise UserError("fit_alpha_beta needs positive times and non-negative sizes")
    c_lat, c_bw = allreduce_coefficients(n, algorithm)
    if c_lat == 0:
        raise UserError("a group of n=1 moves no data; calibrate with 2 or more ranks")
    u = [c_lat / t for t in seconds]  # row i of the relative system: u_i alpha + v_i x = 1, x = 1/B
    v = [c_bw * s / t for s, t in zip(sizes_bytes, seconds, strict=True)]
    suu, svv = sum(a * a for a in u), sum(b * b for b in v)
    suv = sum(a * b for a, b in zip(u, v, strict=True))
    su, sv = sum(u), sum(v)
    det = suu * svv - suv * suv
    alpha = (su * svv - sv * suv) / det if det > 0 else -1.0
    x = (suu * sv - suv * su) / det if det > 0 else 0.0
    if alpha < 0:
        alpha, x = 0.0, sv / svv
    if x <= 0:
        raise UserError("measured times do not grow with message size, so no bandwidth can be fitted; "
                        "include larger sizes (>= 1 MB) in the sweep")
    return alpha, 1.0 / x


def fit_sustained_bandwidth(sizes_bytes: Sequence[float], seconds: Sequence[float], n: int, alpha: float,
                            algorithm: str = "ring", min_bytes: float = 1 << 20) -> float:
    """The bandwidth that best explains the all-reduce times of sizes >= `min_bytes`, alpha given.

    A token-bucket shaper (the emulated cluster's `tbf`, or a NIC's burst allowance) lets a short
    transfer through above the sustained rate, so a fit over a whole sweep overstates the rate a
    step's megabytes of gradients see. Here alpha comes from the whole sweep (`fit_alpha_beta`: the
    small sizes carry the latency) and 1/B minimises the relative error of the sustained sizes alone.
    """
    c_lat, c_bw = allreduce_coefficients(n, algorithm)
    rows = [(s, t) for s, t in zip(sizes_bytes, seconds, strict=True) if s >= min_bytes and t > 0]
    if not rows or c_bw == 0:
        raise UserError(f"no all-reduce of {min_bytes / 2**20:g} MiB or more was timed; "
                        "include larger sizes in the sweep")
    v = [c_bw * s / t for s, t in rows]  # relative rows: v_i x = 1 - c_lat alpha / t_i, x = 1/B
    rhs = [1.0 - c_lat * alpha / t for _, t in rows]
    x = sum(a * b for a, b in zip(v, rhs, strict=True)) / sum(a * a for a in v)
    if x <= 0:
        raise UserError("the sustained sizes took no longer than the latency alone; "
                        "include larger sizes in the sweep")
    return 1.0 / x


def group_key(n: int, dtype: str, algorithm: str, what: str) -> str:
    """The hardware constant holding `what` (bandwidth, latency or cpu_s_per_byte) of the inter-node
    `algorithm` all-reduce of `dtype` payloads among n workers, as `paraloom calibrate` measures it."""
    return f"allreduce.n{n}.{dtype}.{algorithm}.{what}"
