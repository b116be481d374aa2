"""Every hand-written all-reduce equals dist.all_reduce: dtypes, SUM/AVG, odd sizes, 1..8 ranks."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

from paraloom.comm.algorithms import all_gather, all_reduce, block_of, reduce_scatter
from paraloom.config.choices import ALL_REDUCE_ALGORITHMS
from paraloom.config.errors import UserError

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _input(rank, numel, dtype, salt=0):
    """Small integers, so every summation order gives the exact same result in every dtype."""
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-4, 5, (numel,), generator=gen).to(dtype)


def _reference(x, op, world):
    ref = x.clone()
    dist.all_reduce(ref)
    if op == dist.ReduceOp.AVG and world > 1:
        if ref.is_floating_point():
            ref.div_(world)
        else:
            ref = torch.div(ref, world, rounding_mode="trunc")
    return ref


def _mismatches(rank, world, numels, dtypes, segment_bytes=None):
    bad = []
    for algorithm in ALL_REDUCE_ALGORITHMS:
        for dtype in dtypes:
            for numel in numels:
                for op in OPS:
                    x = _input(rank, numel, dtype)
                    ref = _reference(x, op, world)
                    out = all_reduce(x, algorithm=algorithm, op=op, segment_bytes=segment_bytes)
                    if out is not x or not torch.equal(x, ref):
                        bad.append((algorithm, str(dtype), numel, str(op)))
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7])
def test_all_algorithms_equal_native_all_reduce(world):
    numels = (0, 1, world + 1, 3 * world - 1, 1000)
    for bad in run_workers(_mismatches, world, numels, DTYPES):
        assert bad == []


@pytest.mark.parametrize("world", [2, 3, 5])
def test_many_small_segments_pipeline_correctly(world):
    for bad in run_workers(_mismatches, world, (1, 257, 4099), (torch.float32,), segment_bytes=64):
        assert bad == []


@pytest.mark.slow
def test_all_algorithms_on_eight_ranks():
    for bad in run_workers(_mismatches, 8, (0, 1, 9, 1000), DTYPES, timeout=120):
        assert bad == []


def _large(rank, world, dtype, op):
    bad = []
    for algorithm in ALL_REDUCE_ALGORITHMS:
        x = _input(rank, 16 * 2**20, dtype, salt=7)
        ref = _reference(x, op, world)
        all_reduce(x, algorithm=algorithm, op=op)
        if not torch.equal(x, ref):
            bad.append(algorithm)
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, pytest.param(8, marks=pytest.mark.slow)])
def test_sixteen_million_elements(world):
    # every dtype and both ops meet 16M elements somewhere across the world sizes (1-4 give every
    # pair, 5 an odd group past a power of two); test_all_algorithms_equal_native_all_reduce covers
    # 6 and 7 at small sizes, where the blocks' odd splits are what could go wrong
    dtype, op = DTYPES[world % len(DTYPES)], OPS[world % len(OPS)]
    for bad in run_workers(_large, world, dtype, op, timeout=180):
        assert bad == []


def _shapes_and_floats(rank, world):
    results = []
    gen = torch.Generator().manual_seed(rank)
    base = torch.randn(6, 5, generator=gen)
    for algorithm in ALL_REDUCE_ALGORITHMS:
        x = base.t()  # not contiguous: reduced through a flat copy, written back in place
        ref = _reference(x.contiguous(), dist.ReduceOp.AVG, world)
        all_reduce(x, algorithm=algorithm, op=dist.ReduceOp.AVG)
        results.append((algorithm, base.t().clone(), ref))  # read back through the original storage
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_random_floats_and_non_contiguous_tensors(world):
    for results in run_workers(_shapes_and_floats, world):
        for _algorithm, got, ref in results:
            torch.testing.assert_close(got, ref)


def _subgroup(rank, world):
    group = dist.new_group([1, 3])
    out = {}
    if rank in (1, 3):
        for algorithm in ALL_REDUCE_ALGORITHMS:
            x = torch.full((5,), float(rank))
            all_reduce(x, algorithm=algorithm, group=group)
            out[algorithm] = x.tolist()
    return out


def test_subgroups_use_their_own_ranks():
    results = run_workers(_subgroup, 4)
    assert results[0] == results[2] == {}
    for rank in (1, 3):
        assert all(v == [4.0] * 5 for v in results[rank].values())


def _scatter_gather(rank, world, numel):
    out = []
    for algorithm in ("ring", "native"):
        x = _input(rank, numel, torch.float32, salt=3)
        full = _reference(x, dist.ReduceOp.SUM, world)
        mine = reduce_scatter(x, algorithm=algorithm)
        expected = block_of(full, rank, world)
        got_rs = torch.equal(mine, expected)
        y = torch.zeros(numel)
        block_of(y, rank, world).copy_(block_of(full, rank, world))
        all_gather(y, algorithm=algorithm)
        out.append((algorithm, got_rs, torch.equal(y, full)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [0, 1, 10, 1001])
def test_reduce_scatter_and_all_gather(world, numel):
    for results in run_workers(_scatter_gather, world, numel):
        for algorithm, rs_ok, ag_ok in results:
            assert rs_ok, f"{algorithm} reduce_scatter"
            assert ag_ok, f"{algorithm} all_gather"


def _routes(rank, world):
    """Which tensors the backend's all-reduce sends around paraloom's ring, and their sums."""
    from paraloom.comm import algorithms

    calls = []
    ring = algorithms.ALGORITHMS["ring"]
    algorithms.ALGORITHMS["ring"] = lambda flat, peers, **kw: (calls.append(1), ring(flat, peers, **kw))
    half = algorithms.HALF_RING_BYTES // 2
    out = {}
    for name, dtype, numel in (("fp16 large", torch.float16, half), ("fp16 small", torch.float16, half - 1),
                               ("bf16 large", torch.bfloat16, half), ("fp32 large", torch.float32, half)):
        calls.clear()
        x = _input(rank, numel, dtype, salt=5)
        ref = _reference(x, dist.ReduceOp.AVG, world)
        all_reduce(x, op=dist.ReduceOp.AVG)
        out[name] = (len(calls), torch.equal(x, ref))
    return out


def test_gloo_float16_goes_around_the_ring():
    for out in run_workers(_routes, 2):
        assert out == {"fp16 large": (1, True), "fp16 small": (0, True), "bf16 large": (0, True),
                       "fp32 large": (0, True)}


def test_unknown_algorithm_lists_choices():
    with pytest.raises(UserError, match="choose one of: native, ring, halving_doubling, tree, one_to_all"):
        all_reduce(torch.zeros(1), algorithm="butterfly")
