"""Topology: the rank grid for every factorisation of 1..8 ranks, and its process groups."""

import itertools

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

from paraloom.config.errors import UserError
from paraloom.topology import AXES, Topology


def factorisations(max_world=8):
    for world in range(1, max_world + 1):
        for tp, pp in itertools.product(range(1, world + 1), repeat=2):
            if world % (tp * pp) == 0:
                yield world, world // (tp * pp), tp, pp


@pytest.mark.parametrize(("world", "dp", "tp", "pp"), list(factorisations()))
def test_grid_is_a_bijection_with_consistent_groups(world, dp, tp, pp):
    topo = Topology.for_world(world, tp=tp, pp=pp)
    assert (topo.dp, topo.tp, topo.pp, topo.world_size) == (dp, tp, pp, world)
    coords = [topo.coord(r) for r in range(world)]
    assert len(set(coords)) == world
    for r, c in enumerate(coords):
        assert topo.rank(pp=c.pp, dp=c.dp, tp=c.tp) == r
    for axis in AXES:
        size = getattr(topo, axis)
        groups = topo.groups(axis)
        assert len(groups) == world // size
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        for g in groups:  # members agree on every other coordinate, differ on this one
            others = {tuple(v for a, v in topo.coord(r)._asdict().items() if a != axis) for r in g}
            assert len(others) == 1
            assert sorted(getattr(topo.coord(r), axis) for r in g) == list(range(size))


def test_tensor_parallel_neighbours_are_adjacent_ranks():
    topo = Topology(dp=2, tp=2, pp=2)
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_groups_along_several_axes_hold_one_replica_each():
    topo = Topology(dp=2, tp=2, pp=2)
    assert topo.groups("tp", "pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one per dp index
    assert topo.groups("pp", "dp", "tp") == [list(range(8))]
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        topo.groups("tp", "ep")


def test_bad_factorisation_names_the_valid_choices():
    with pytest.raises(UserError, match=r"tp=3 x pp=1 does not divide 8 ranks; choose tp in \{1, 2, 4, 8\}"):
        Topology.for_world(8, tp=3)
    with pytest.raises(UserError, match="positive integer"):
        Topology(dp=0)


def _groups_reduce(rank, world, tp, pp):
    topo = Topology.for_world(world, tp=tp, pp=pp)
    groups = topo.init_groups()
    out = {}
    for axis in AXES:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(groups, f"{axis}_group"))
        out[axis] = t.item()
    out["coord"] = (groups.pp_rank, groups.dp_rank, groups.tp_rank)
    out["stages"] = (groups.pp_is_first_stage, groups.pp_is_last_stage)
    return out


@pytest.mark.parametrize(("world", "tp", "pp"), [(1, 1, 1), (2, 2, 1), (4, 2, 1), (4, 1, 2),
                                                 (6, 3, 1), (6, 1, 3)])
def test_process_groups_reduce_over_their_axis(world, tp, pp):
    topo = Topology.for_world(world, tp=tp, pp=pp)
    results = run_workers(_groups_reduce, world, tp, pp)
    for rank, out in enumerate(results):
        assert out["coord"] == tuple(topo.coord(rank))
        assert out["stages"] == (topo.coord(rank).pp == 0, topo.coord(rank).pp == pp - 1)
        for axis in AXES:
            assert out[axis] == sum(topo.group_of(axis, rank))


@pytest.mark.slow
def test_process_groups_on_eight_ranks():
    topo = Topology(dp=2, tp=2, pp=2)
    for rank, out in enumerate(run_workers(_groups_reduce, 8, 2, 2, timeout=120)):
        for axis in AXES:
            assert out[axis] == sum(topo.group_of(axis, rank))
