"""Scheduler overlap formulas against hand-simulated timelines (send time = bytes / 100 s)."""

import pytest

from paraloom.perfmodel.cost.overlap import (
    LayerTimes,
    fifo_exposed,
    one_step_delay_exposed,
    piece_count,
    priority_exposed,
    total_comm,
    wait_free_exposed,
)


def send(nbytes):
    return nbytes / 100


EVEN = [LayerTimes(1.0, 1.0, 100.0), LayerTimes(1.0, 1.0, 100.0)]
HEAVY_TOP = [LayerTimes(1.0, 1.0, 100.0), LayerTimes(1.0, 1.0, 300.0)]  # the last layer holds most bytes


def test_fifo_exposes_everything():
    assert fifo_exposed(EVEN, send, 1000) == pytest.approx(2.0)
    assert fifo_exposed(EVEN, send, 50) == pytest.approx(2.0)  # four buckets of 50, back to back
    assert total_comm(HEAVY_TOP, send, 1000) == pytest.approx(4.0)


def test_wait_free_hides_all_but_the_last_bucket():
    # layer 1 ready at 1 s: its bucket goes 1 -> 2; layer 0 ready at 2 s: 2 -> 3; backward ends at 2
    assert wait_free_exposed(EVEN, send, 100, 100) == pytest.approx(1.0)
    # heavy top: a 100-byte first bucket 1 -> 2, then 300 bytes wait for the end of backward: 2 -> 5
    assert wait_free_exposed(HEAVY_TOP, send, 1000, 100) == pytest.approx(3.0)


def test_priority_sends_what_the_next_forward_needs_first():
    # pieces of 100: layer 1's first piece 1 -> 2, then layer 0 (ready at 2, first in forward) 2 -> 3,
    # then layer 1's other two 3 -> 5. Next forward: layer 0 at max(2, 3) + 1 = 4, layer 1 at
    # max(4, 5) + 1 = 6; exposed = 6 - 2 (backward) - 2 (forward) = 2, against wait_free's 3.
    assert priority_exposed(HEAVY_TOP, send, 100) == pytest.approx(2.0)
    assert priority_exposed(HEAVY_TOP, send, 100) < wait_free_exposed(HEAVY_TOP, send, 1000, 100)


def test_priority_pieces_in_flight_overlap_their_latency_with_the_bytes_before():
    """One layer of 300 bytes ready at 0, pieces of 100, a piece = 1 s of latency + 1 s of bytes.
    One at a time: 3 x 2 = 6 s. Two in flight: 2 s, then 1 s each (the larger of latency and
    bytes) = 4 s; a link that went idle in between starts the next piece afresh."""
    def with_latency(nbytes):
        return 1.0 + nbytes / 100

    one = [LayerTimes(0.0, 0.0, 300.0)]
    assert priority_exposed(one, with_latency, 100) == pytest.approx(6.0)
    assert priority_exposed(one, with_latency, 100, in_flight=4) == pytest.approx(4.0)
    # two layers, each one piece, the second ready long after the first is sent: no overlap
    apart = [LayerTimes(0.0, 10.0, 100.0), LayerTimes(0.0, 0.0, 100.0)]
    assert priority_exposed(apart, with_latency, 100, in_flight=4) == \
        priority_exposed(apart, with_latency, 100) == pytest.approx(2.0)


def test_priority_coarsens_pieces_but_keeps_the_bytes():
    many = [LayerTimes(0.0, 0.0, 1e6)] * 10
    assert priority_exposed(many, send, 1.0, max_pieces=100) == pytest.approx(1e5, rel=1e-9)


@pytest.mark.parametrize("partition_mb", [0.5, 1.0, 2.0, 8.0, 32.0])
def test_pieces_are_counted_as_the_priority_engine_cuts_them(partition_mb):
    """The MLP the validation runs (64 -> 1024 -> 1024 -> 1024 -> 10), its parameters in backward
    order grouped by the engine's own `assign_buckets` with the partition as both caps, each
    bucket cut into partitions (`cut_pieces`): the model's count, at the granularity of layers."""
    import math

    import torch

    from paraloom.data_parallel.bucket import assign_buckets

    shapes = [(64, 1024), (1024, 1024), (1024, 1024), (1024, 10)]
    layers = [LayerTimes(0.0, 0.0, 4.0 * (i * o + o)) for i, o in shapes]
    sizes = [(4 * n, torch.float32) for i, o in reversed(shapes) for n in (o, i * o)]  # bias, weight
    cap = int(partition_mb * 2**20)
    buckets = assign_buckets(sizes, cap, cap)
    engine = sum(math.ceil(sum(sizes[j][0] for j in members) / cap) for members in buckets)
    assert piece_count(layers, cap) == engine
    assert piece_count([], cap) == 0


def test_one_step_delay_hides_up_to_a_whole_step():
    assert one_step_delay_exposed(EVEN, send, 1000) == 0.0  # 2 s of comm under 4 s of compute
    assert one_step_delay_exposed(EVEN, lambda b: b / 25, 1000) == pytest.approx(4.0)  # 8 s under 4


def test_nothing_to_send_exposes_nothing():
    empty = [LayerTimes(1.0, 1.0, 0.0)]
    assert fifo_exposed(empty, send, 100) == wait_free_exposed(empty, send, 100, 10) == 0.0
    assert priority_exposed(empty, send, 100) == 0.0


def test_mean_value_analysis_by_hand():
    from paraloom.perfmodel.cost.queueing import asp_cycle, mva_cycle

    # one customer: no queueing, the cycle is the sum of the demands and the delay
    assert mva_cycle(1, [0.7, 0.7], 0.05) == pytest.approx(1.45)
    # two: X1 = 1/1.45, Q1 = 0.7/1.45 per station; R2 = 0.7 (1 + Q1) each; cycle = 2 R2 + 0.05
    r2 = 0.7 * (1 + 0.7 / 1.45)
    assert mva_cycle(2, [0.7, 0.7], 0.05) == pytest.approx(2 * r2 + 0.05)
    # asynchronous workers land between a perfect stagger (1.45) and lock step (2 x 1.4 + 0.05)
    cycle = asp_cycle(2, 1, 0.7, 0.7, 0.05)
    assert 1.45 < cycle < 2.85
    # more shards spread the servers' load: faster, never below one worker's own transfers
    assert 1.4 < asp_cycle(2, 4, 0.7, 0.7, 0.05) < cycle
    # slices: push and pull overlap, one station of demand 0.7 + 0.7 / 7 = 0.8 (exact MVA by hand)
    r2 = 0.8 * (1 + 0.8 / 0.85)
    assert asp_cycle(2, 1, 0.7, 0.7, 0.05, slices=7) == pytest.approx(r2 + 0.05)
    assert asp_cycle(2, 1, 0.7, 0.7, 0.05, slices=1) == pytest.approx(cycle)
    # the servers' CPU (0.3 s a visit) handles one slice while the next arrives: one station of
    # 0.8 + 0.3 / 7, against the link's 0.8 alone
    d = 0.8 + 0.3 / 7
    expected = d * (1 + d / (d + 0.05)) + 0.05
    assert asp_cycle(2, 1, 0.7, 0.7, 0.05, slices=7, server_cpu_s=0.3) == pytest.approx(expected)
    # a CPU slower than the link sets the pace the same way: 2.0 + 0.8 / 7
    d = 2.0 + 0.8 / 7
    assert asp_cycle(2, 1, 0.7, 0.7, 0.05, slices=7, server_cpu_s=2.0) == \
        pytest.approx(d * (1 + d / (d + 0.05)) + 0.05)
    # one message a shard: nothing to overlap, the CPU is one more station after the link
    q = [0.7 / 1.75, 0.7 / 1.75, 0.3 / 1.75]
    expected = sum(x * (1 + y) for x, y in zip([0.7, 0.7, 0.3], q, strict=True)) + 0.05
    assert asp_cycle(2, 1, 0.7, 0.7, 0.05, slices=1, server_cpu_s=0.3) == pytest.approx(expected)
