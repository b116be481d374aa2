"""Modelled wire bytes against the payloads the real compressors produce, and the exchange time."""

from dataclasses import dataclass

import pytest
import torch

from paraloom.compress import COMPRESSORS, make_compressor
from paraloom.compress.powersgd import PowerSGDState
from paraloom.config.choices import COMPRESSORS as COMPRESSOR_NAMES
from paraloom.config.errors import UserError
from paraloom.data_parallel.lowrank import PowerSGDReducer
from paraloom.perfmodel.cost.compression import (
    compressed_bytes,
    compressed_sync_time,
    powersgd_rounds,
    summable,
)
from paraloom.perfmodel.cost.network import allgather_time, allreduce_time


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float
    latency: float


GBIT = Link("1gbit", 1.25e8, 1e-4)
CASES = [
    ("fp16", {}), ("bf16", {}),
    ("qsgd", {}), ("qsgd", {"bits": 4}), ("qsgd", {"bits": 2, "block": 100}),
    ("onebit", {}), ("efsign", {}), ("efsign", {"block": 64}),
    ("topk", {}), ("topk", {"density": 0.001}), ("randomk", {}), ("randomk", {"density": 0.5}),
    ("dgc", {}), ("dgc", {"density": 0.05, "momentum": 0.0}),
]


@pytest.mark.parametrize("count", [1, 1001, 65536, 100_003])
@pytest.mark.parametrize(("name", "options"), CASES)
def test_bytes_match_the_real_payload(name, options, count):
    payload, _ = make_compressor(name, **options).compress(torch.randn(count), 0)
    real = payload.numel() * payload.element_size()
    assert compressed_bytes(4 * count, name, **options) == real


def powersgd_real_bytes(shapes: list[tuple[int, ...]], rank: int) -> int:
    """Bytes PowerSGDState puts in its two all-reduces for gradients of `shapes` (plain ones as they are)."""
    state = PowerSGDState(rank=rank, start_iter=0)
    total = 0
    for key, shape in enumerate(shapes):
        grad = torch.randn(shape)
        if not state.should_compress(shape):
            total += grad.numel() * 4
            continue
        p = state.p_matrices(key, grad)
        q = state.q_matrices(key, p)
        total += (p.numel() + q.numel()) * 4
    return total


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_bytes_match_the_real_factors(rank):
    shapes = [(256, 128), (64,), (32, 16, 3, 3), (4, 5), (1000, 10)]
    count = sum(torch.Size(s).numel() for s in shapes)
    expected = powersgd_real_bytes(shapes, rank)
    assert compressed_bytes(4 * count, "powersgd", rank=rank, shapes=shapes) == expected
    # elements the shapes leave out travel plainly
    assert compressed_bytes(4 * (count + 7), "powersgd", rank=rank, shapes=shapes) == expected + 28


def test_powersgd_square_assumption():
    assert compressed_bytes(4 * 1024 * 1024, "powersgd") == powersgd_real_bytes([(1024, 1024)], 2) == 16384
    assert compressed_bytes(4 * 16, "powersgd", rank=2) == 64  # 4 x 4: r(m + n) = 16 is not smaller: plain
    with pytest.raises(UserError, match="shapes hold"):
        compressed_bytes(40, "powersgd", shapes=[(4, 4)])


def test_none_is_fp32():
    assert compressed_bytes(4000, None) == compressed_bytes(4000, "none") == 4000


def test_summable_matches_the_classes():
    for name in COMPRESSORS:
        assert summable(name) == COMPRESSORS[name].summable, name
    assert summable("powersgd") == PowerSGDReducer.summable
    assert set(COMPRESSOR_NAMES) == {*COMPRESSORS, "powersgd"}


def test_unknown_names_and_options_say_what_exists():
    with pytest.raises(UserError, match="topk"):
        compressed_bytes(4000, "zip")
    with pytest.raises(UserError, match="density"):
        compressed_bytes(4000, "topk", desnity=0.1)
    with pytest.raises(UserError, match=r"\{2, 4, 8\}"):
        compressed_bytes(4000, "qsgd", bits=3)
    assert compressed_bytes(4000, "topk", error_feedback=False, seed=3) == 80  # size-neutral options pass


def test_sync_time_picks_the_collective():
    s, n = 100e6, 4
    assert compressed_sync_time(s, n, GBIT, None) == allreduce_time(s, n, GBIT)
    assert compressed_sync_time(s, n, GBIT, "fp16", "tree") == allreduce_time(s / 2, n, GBIT, "tree")
    topk = compressed_bytes(s, "topk", density=0.01)  # all-gathered: every rank receives 3 payloads
    assert compressed_sync_time(s, n, GBIT, "topk", density=0.01) == allgather_time(n * topk, n, GBIT)
    assert allgather_time(n * topk, n, GBIT) == pytest.approx(3e-4 + 3 * topk / 1.25e8)
    # powersgd: two rounds, so two rounds of latency
    first, second = powersgd_rounds(25_000_000)
    assert compressed_sync_time(s, n, GBIT, "powersgd") == pytest.approx(
        allreduce_time(4 * first, n, GBIT) + allreduce_time(4 * second, n, GBIT))
    assert compressed_sync_time(s, 1, GBIT, "topk") == 0


def test_gathered_payloads_cost_more_with_more_ranks():
    times = [compressed_sync_time(100e6, n, GBIT, "topk") for n in (2, 4, 8, 16)]
    assert times == sorted(times) and times[-1] / times[0] > 5  # (n-1) payloads arrive at every rank
