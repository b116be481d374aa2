"""Communication cost formulas against hand-computed figures, and the alpha-beta fit."""

import random
from dataclasses import dataclass

import pytest

from paraloom.config.choices import ALL_REDUCE_ALGORITHMS, MODELLED_ALGORITHMS
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.network import (
    allgather_time,
    allreduce_coefficients,
    allreduce_time,
    broadcast_time,
    fit_alpha_beta,
    fit_sustained_bandwidth,
    group_allreduce_time,
    group_link,
    hierarchical_allreduce_time,
    p2p_time,
    ps_pull_time,
    ps_time,
    reduce_scatter_time,
)


@dataclass(frozen=True)
class Link:  # the fields of perfmodel.hardware.Link; the formulas take any object that has them
    name: str
    bandwidth: float
    latency: float


GBIT = Link("1gbit", 1.25e8, 1e-4)
NVLINK = Link("nvlink", 2e11, 5e-6)
S = 100e6

# (c_lat, c_bw) worked out by hand from comm/algorithms.py for each algorithm and group size
HAND = {
    ("ring", 4): (6, 1.5), ("ring", 3): (4, 4 / 3),
    ("halving_doubling", 4): (4, 1.5), ("halving_doubling", 8): (6, 1.75),
    ("halving_doubling", 3): (4, 3),  # fold 0 -> 1, one exchange of S/2 each way on p = 2, unfold
    ("halving_doubling", 6): (6, 3.5),  # p = 4: 2 x 2 steps, 2 x 3/4 S, plus fold and unfold
    ("tree", 2): (2, 2), ("tree", 4): (4, 5),  # reduce 2 levels; root sends to 2 and 1 at once, 2 -> 3
    ("tree", 5): (5, 7),  # reduce 3 levels; root -> {4, 2, 1} (3 copies), then 2 -> 3
    ("tree", 8): (6, 9),  # reduce 3; broadcast 0 -> {4,2,1}, 4 -> {6,5}, 6 -> 7: 3 + 2 + 1 copies
    ("one_to_all", 4): (4, 6),  # 3 receives in turn, then 3 sends at once: 2(n-1) copies, n latencies
    # other systems' trees, priced only: Paleo's reduce + broadcast, 2 log2 n steps of S; NCCL's double
    # binary tree, the same depth and 2 S each way (half the vector per tree, pipelined)
    ("reduction_tree", 2): (2, 2), ("reduction_tree", 8): (6, 6), ("reduction_tree", 5): (6, 6),
    ("reduction_tree", 128): (14, 14),
    ("double_binary_tree", 8): (6, 2), ("double_binary_tree", 128): (14, 2),
}


def test_ring_worked_example():
    # 2(n-1)/n S/B = 1.5 * 100 MB / 125 MB/s = 1.2 s; 2(n-1) alpha = 6e-4 s
    assert allreduce_time(S, 4, GBIT) == pytest.approx(1.2 + 6e-4, rel=1e-12)


@pytest.mark.parametrize(("algorithm", "n"), list(HAND))
def test_allreduce_against_hand_counts(algorithm, n):
    c_lat, c_bw = HAND[algorithm, n]
    assert allreduce_coefficients(n, algorithm) == pytest.approx((c_lat, c_bw))
    assert allreduce_time(S, n, GBIT, algorithm) == pytest.approx(c_lat * 1e-4 + c_bw * S / 1.25e8)


@pytest.mark.parametrize("algorithm", ALL_REDUCE_ALGORITHMS + MODELLED_ALGORITHMS)
def test_one_rank_costs_nothing(algorithm):
    assert allreduce_time(S, 1, GBIT, algorithm) == 0
    assert hierarchical_allreduce_time(S, 1, 1, NVLINK, GBIT, algorithm) == 0
    assert reduce_scatter_time(S, 1, GBIT) == allgather_time(S, 1, GBIT) == broadcast_time(S, 1, GBIT) == 0


def test_native_is_modelled_as_the_ring():
    for n in (2, 3, 4, 7, 16):
        assert allreduce_time(S, n, GBIT, "native") == allreduce_time(S, n, GBIT, "ring")


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_halving_doubling_moves_the_ring_bytes_on_powers_of_two(n):
    free = Link("no-latency", 1.25e8, 0.0)
    assert allreduce_time(S, n, free, "halving_doubling") == pytest.approx(allreduce_time(S, n, free, "ring"))
    assert allreduce_coefficients(n, "halving_doubling")[0] == 2 * (n.bit_length() - 1)  # 2 log2 n steps


@pytest.mark.parametrize("algorithm", ALL_REDUCE_ALGORITHMS)
def test_monotone_in_size(algorithm):
    times = [allreduce_time(s, 5, GBIT, algorithm) for s in (0, 1e3, 1e6, 1e8)]
    assert times == sorted(times) and times[0] > 0  # latency remains at size 0


@pytest.mark.parametrize("algorithm", ["ring", "native", "tree", "one_to_all"])
def test_monotone_in_group_size(algorithm):
    times = [allreduce_time(S, n, GBIT, algorithm) for n in range(1, 65)]
    assert times == sorted(times)


def test_halving_doubling_pays_for_folding():
    # 5 ranks fold into 4: more than 4 and more than 8 (the non-power-of-two penalty of the code)
    t = {n: allreduce_time(S, n, GBIT, "halving_doubling") for n in (4, 5, 8)}
    assert t[5] > t[8] > t[4]


def test_reduce_scatter_plus_allgather_is_the_ring():
    for n in (2, 3, 4, 9):
        parts = reduce_scatter_time(S, n, GBIT) + allgather_time(S, n, GBIT)
        assert parts == pytest.approx(allreduce_time(S, n, GBIT, "ring"))
    assert reduce_scatter_time(S, 4, GBIT) == pytest.approx(3e-4 + 0.75 * 0.8)


def test_broadcast_and_p2p():
    # gloo's binomial broadcast to 4: root sends to 1 and 2 at once (2 copies), then 1 -> 3
    assert broadcast_time(S, 4, GBIT) == pytest.approx(2e-4 + 3 * 0.8)
    assert broadcast_time(S, 6, GBIT) == pytest.approx(2e-4 + 5 * 0.8)  # 0 -> {1,2,4}, 1 -> {3,5}
    assert p2p_time(S, GBIT) == pytest.approx(1e-4 + 0.8)
    assert p2p_time(0, GBIT) == 1e-4


def test_unknown_algorithms_say_what_exists():
    with pytest.raises(UserError, match="halving_doubling"):
        allreduce_time(S, 4, GBIT, "butterfly")
    with pytest.raises(UserError, match="ring or native"):
        reduce_scatter_time(S, 4, GBIT, "tree")
    with pytest.raises(UserError, match="positive integer"):
        allreduce_time(S, 0, GBIT)


def test_group_link():
    assert group_link(8, 8, NVLINK, GBIT) is NVLINK
    assert group_link(9, 8, NVLINK, GBIT) is GBIT
    assert group_link(1, 8, NVLINK, GBIT) is NVLINK
    assert group_link(2, 8, NVLINK, GBIT, stride=4) is NVLINK  # ranks 0 and 4
    assert group_link(2, 8, NVLINK, GBIT, stride=8) is GBIT  # ranks 0 and 8: another node


def test_hierarchical_allreduce():
    # one node: the flat formula on the intra-node link
    assert hierarchical_allreduce_time(S, 1, 8, NVLINK, GBIT) == allreduce_time(S, 8, NVLINK)
    # 2 nodes x 4: a ring of 8 leaves each node by one edge, at 1 Gbit/s and the larger latency
    ring = hierarchical_allreduce_time(S, 2, 4, NVLINK, GBIT, "ring")
    assert ring == pytest.approx(14 * 1e-4 + 1.75 * S / 1.25e8)
    # halving-doubling: the 4 ranks of a node cross the NIC at once, a quarter of it each
    hd = hierarchical_allreduce_time(S, 2, 4, NVLINK, GBIT, "halving_doubling")
    assert hd == pytest.approx(6 * 1e-4 + 1.75 * S / (1.25e8 / 4))
    # more ranks per node never makes the flat ring over nodes cheaper
    times = [hierarchical_allreduce_time(S, 4, k, NVLINK, GBIT) for k in (1, 2, 4, 8)]
    assert times == sorted(times)
    # with an adapter for each of the node's ranks, halving-doubling's flows each have their own;
    # one ring is one flow and uses one adapter however many there are
    assert hierarchical_allreduce_time(S, 2, 4, NVLINK, GBIT, "halving_doubling", nics=4) == pytest.approx(
        6 * 1e-4 + 1.75 * S / 1.25e8)
    assert hierarchical_allreduce_time(S, 2, 4, NVLINK, GBIT, "ring", nics=4) == ring
    # two data-parallel groups on a node with one adapter: half of it each
    assert hierarchical_allreduce_time(S, 2, 4, NVLINK, GBIT, "ring", nics=0.5) == pytest.approx(
        14 * 1e-4 + 1.75 * S / (1.25e8 / 2))


def test_parameter_server_step():
    # 4 workers, 1 server, 1.2 MB: the server's NIC carries 4 x 1.2 MB each way (BENCHMARKS.md: ~80 ms)
    link = Link("bench", 1.2e8, 0.0)
    one = ps_time(1.2e6, 4, 1, link)
    assert one == pytest.approx(2 * 4 * (1.2e6 + 16) / 1.2e8)
    assert one == pytest.approx(0.08, rel=1e-3)
    # 4 servers: server and worker NICs each carry 1.2 MB + headers each way
    assert ps_time(1.2e6, 4, 4, link) == pytest.approx(2 * (1.2e6 + 64) / 1.2e8)
    # more servers than workers: the workers' NICs bound it
    assert ps_time(1.2e6, 2, 4, link) == pytest.approx(2 * (1.2e6 + 64) / 1.2e8)
    # a compressed push shrinks only the push phase; latency once per phase
    assert ps_time(1.2e6, 4, 1, GBIT, push_bytes=0.3e6) == pytest.approx(
        2e-4 + 4 * (0.3e6 + 16) / 1.25e8 + 4 * (1.2e6 + 16) / 1.25e8)
    # 3 slices: the replies of one slice leave while the next comes in; the shorter phase is paid
    # for its last slice only, and every slice's message has a header
    assert ps_time(1.2e6, 4, 1, link, slices=3) == pytest.approx(
        4 * (1.2e6 + 48) / 1.2e8 + 4 * (1.2e6 + 48) / 1.2e8 / 3)
    assert ps_time(1.2e6, 4, 1, GBIT, push_bytes=0.3e6, slices=4) == pytest.approx(
        2e-4 + 4 * (1.2e6 + 64) / 1.25e8 + 4 * (0.3e6 + 64) / 1.25e8 / 4)



def test_co_located_servers_keep_a_nodes_own_share_off_its_nic():
    link = Link("bench", 1.2e8, 0.0)
    # 4 nodes, a server on each: a node sends 3 of the 4 shards it pushes, and its server receives
    # 3 workers' pushes of one shard (apart: 4 shards out, 4 workers' in)
    assert ps_time(1.2e6, 4, 4, link, colocated=True) == pytest.approx(2 * 0.75 * (1.2e6 + 64) / 1.2e8)
    # 4 nodes, 2 servers: the nodes without a server send everything; a server's node receives 3 halves
    assert ps_time(1.2e6, 4, 2, link, colocated=True) == pytest.approx(2 * 3 * (0.6e6 + 16) / 1.2e8)
    assert ps_time(1.2e6, 4, 2, link) == pytest.approx(2 * 4 * (0.6e6 + 16) / 1.2e8)
    # one node holding its own server has no NIC to spare: the link given (its PCIe) carries it all
    assert ps_time(1.2e6, 1, 1, link, colocated=True) == pytest.approx(2 * (1.2e6 + 16) / 1.2e8)
    with pytest.raises(UserError, match="co-located parameter servers need as many nodes"):
        ps_time(1.2e6, 2, 4, link, colocated=True)


def test_the_pull_phase_alone():
    link = Link("bench", 1.2e8, 1e-3)
    assert ps_pull_time(1.2e6, 4, 1, link) == pytest.approx(1e-3 + 4 * (1.2e6 + 16) / 1.2e8)
    assert ps_pull_time(1.2e6, 4, 4, link, colocated=True) == pytest.approx(
        1e-3 + 0.75 * (1.2e6 + 64) / 1.2e8)
    # one slice: the step is its push phase and its pull phase, each with its latency
    assert ps_time(1.2e6, 4, 1, link) == pytest.approx(2 * ps_pull_time(1.2e6, 4, 1, link))


SIZES = [4 ** k * 1024 for k in range(9)]  # 1 KB .. 64 MB


@pytest.mark.parametrize(("algorithm", "n"), [("ring", 4), ("ring", 2), ("halving_doubling", 6),
                                              ("tree", 5), ("one_to_all", 4)])
def test_fit_recovers_alpha_and_bandwidth(algorithm, n):
    truth = Link("true", 1.2e8, 1.5e-3)
    times = [allreduce_time(s, n, truth, algorithm) for s in SIZES]
    alpha, bandwidth = fit_alpha_beta(SIZES, times, n, algorithm)
    assert alpha == pytest.approx(1.5e-3, rel=1e-9)
    assert bandwidth == pytest.approx(1.2e8, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_fit_with_five_percent_noise(seed):
    rng = random.Random(seed)
    truth = Link("true", 1.2e8, 1.5e-3)
    times = [allreduce_time(s, 4, truth) * (1 + rng.uniform(-0.05, 0.05)) for s in SIZES for _ in range(3)]
    alpha, bandwidth = fit_alpha_beta([s for s in SIZES for _ in range(3)], times, 4)
    assert alpha == pytest.approx(1.5e-3, rel=0.10)
    assert bandwidth == pytest.approx(1.2e8, rel=0.10)


def test_fit_clamps_negative_latency():
    # pure bandwidth with small dips at small sizes would fit a negative alpha: clamped to 0
    times = [s * 1.5 / 1e8 * (0.9 if s < 1e5 else 1.0) for s in SIZES]
    alpha, bandwidth = fit_alpha_beta(SIZES, times, 4)
    assert alpha == 0.0 and bandwidth > 0


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(UserError, match="2 or more distinct sizes"):
        fit_alpha_beta([1e6, 1e6], [0.01, 0.011], 4)
    with pytest.raises(UserError, match="n=1"):
        fit_alpha_beta([1e3, 1e6], [0.01, 0.02], 1)
    with pytest.raises(UserError, match="do not grow"):
        fit_alpha_beta([1e3, 1e6], [0.02, 0.01], 4)
    with pytest.raises(UserError, match="2 sizes but 1 times"):
        fit_alpha_beta([1e3, 1e6], [0.02], 4)


def test_sustained_fit_ignores_the_burst_that_speeds_up_short_transfers():
    truth = Link("true", 1.2e8, 1.5e-3)
    burst = Link("burst", 6e8, 1.5e-3)  # a token bucket lets transfers under 1 MiB through 5x faster
    times = [allreduce_time(s, 4, burst if s < 2**20 else truth) for s in SIZES]
    _, whole = fit_alpha_beta(SIZES, times, 4)
    assert whole > 1.01 * 1.2e8  # the whole sweep overstates the sustained rate
    assert fit_sustained_bandwidth(SIZES, times, 4, 1.5e-3) == pytest.approx(1.2e8, rel=1e-9)
    with pytest.raises(UserError, match="no all-reduce of 1 MiB or more"):
        fit_sustained_bandwidth(SIZES[:3], times[:3], 4, 1.5e-3)
    with pytest.raises(UserError, match="no longer than the latency"):
        fit_sustained_bandwidth([2**20], [1e-3], 4, 1e-3)


def test_at_128_ranks_the_named_trees_cost_what_their_sources_say():
    """paraloom's binomial tree (root sends to all its children at once) moves about 35 S/B at 128
    ranks; a reduction tree 2 log2 n = 14; NCCL's pipelined double binary tree about the ring's 2."""
    big = Link("ib", 25e9, 0.0)
    ring, tree, reduction, double = (allreduce_time(S, 128, big, a) * big.bandwidth / S
                                     for a in ("ring", "tree", "reduction_tree", "double_binary_tree"))
    assert tree == pytest.approx(35) and reduction == pytest.approx(14) and double == pytest.approx(2)
    assert ring < double < reduction < tree
    with pytest.raises(UserError, match="double_binary_tree"):  # the message lists the names
        allreduce_coefficients(4, "butterfly")


def test_a_hierarchical_all_reduce_sums_inside_each_node_first():
    """Goyal et al.'s three phases: 2 nodes x 4 ranks, one adapter: a ring inside each node, then the
    node's 4 ranks each all-reduce a quarter across the 2 nodes at once (S through the one adapter),
    where flat halving-doubling sends 4 flows of the whole vector through it."""
    inside = allreduce_time(S, 4, NVLINK, "ring")
    across = allreduce_time(S / 4, 2, Link("a quarter", 1.25e8 / 4, 1e-4), "halving_doubling")
    hier = group_allreduce_time(S, 2, 4, NVLINK, GBIT, "hierarchical_halving_doubling")
    assert hier == pytest.approx(inside + across)
    flat = group_allreduce_time(S, 2, 4, NVLINK, GBIT, "halving_doubling")
    assert flat == hierarchical_allreduce_time(S, 2, 4, NVLINK, GBIT, "halving_doubling")
    assert hier < flat / 3
    # an adapter for each rank: the four quarters cross at once, each at a whole adapter's rate
    assert group_allreduce_time(S, 2, 4, NVLINK, GBIT, "hierarchical_ring", nics=4) == pytest.approx(
        inside + allreduce_time(S / 4, 2, GBIT, "ring"))
    # one rank a node, or one node: nothing to sum inside first
    assert group_allreduce_time(S, 4, 1, NVLINK, GBIT, "hierarchical_ring") == allreduce_time(S, 4, GBIT)
    assert group_allreduce_time(S, 1, 8, NVLINK, GBIT, "hierarchical_ring") == allreduce_time(S, 8, NVLINK)
