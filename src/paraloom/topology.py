"""Topology(dp, tp, pp): the rank grid, and the process group of each axis for one rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from paraloom.comm.collectives import default_timeout
from paraloom.config.errors import UserError

AXES = ("pp", "dp", "tp")  # outermost to innermost: tp neighbours are adjacent ranks (Megatron order)


def node_count(world: int) -> int:
    """Nodes the run's `world` ranks are spread over: torchrun puts LOCAL_WORLD_SIZE on each (a run
    launched on this machine alone is one node; one on an emulated cluster has one rank a node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return max(1, world // max(1, local))


class Coord(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """A dp x tp x pp grid of ranks; rank = (pp * dp_size + dp) * tp_size + tp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise UserError(f"topology {axis}={size!r} must be a positive integer")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> Topology:
        """The grid for world_size ranks; dp is what tp and pp leave over."""
        if world_size < 1:
            raise UserError(f"world size {world_size} must be at least 1")
        if world_size % (tp * pp):
            options = [t for t in range(1, world_size + 1) if world_size % (t * pp) == 0]
            raise UserError(f"tp={tp} x pp={pp} does not divide {world_size} ranks; "
                            f"choose tp in {{{', '.join(map(str, options))}}}")
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coord(pp=pp_rank, dp=dp_rank, tp=tp_rank)

    def rank(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group along `axes`: ranks that differ only in those coordinates, in rank order
        (`groups("tp", "pp")`: the ranks that together hold one data-parallel replica)."""
        for axis in axes:
            if axis not in AXES:
                raise ValueError(f"unknown axis {axis!r}; axes: {', '.join(AXES)}")
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coord(r)._asdict()
            key = tuple(v for name, v in c.items() if name not in axes)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def new_group(self, *axes: str, timeout: timedelta | None = None) -> dist.ProcessGroup:
        """This rank's process group along `axes` (collective: every rank makes every such group)."""
        groups = self.groups(*axes)
        return dist.new_subgroups_by_enumeration(groups, timeout=timeout or default_timeout())[0]

    def init_groups(self, timeout: timedelta | None = None) -> RankGroups:
        """Create the process groups of every axis (collective: all ranks must call it)."""
        if not dist.is_initialized():
            raise RuntimeError("init_groups needs an initialized default process group")
        if dist.get_world_size() != self.world_size:
            raise UserError(f"topology dp={self.dp} tp={self.tp} pp={self.pp} needs "
                            f"{self.world_size} ranks, but {dist.get_world_size()} are running")
        rank = dist.get_rank()
        handles = {axis: dist.group.WORLD if getattr(self, axis) == self.world_size
                   else self.new_group(axis, timeout=timeout) for axis in AXES}
        return RankGroups(self, rank, handles["dp"], handles["tp"], handles["pp"])


@dataclass(frozen=True)
class RankGroups:
    """One rank's view of the grid: its coordinates and the process group of each axis."""

    topology: Topology
    rank: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup

    @property
    def dp_rank(self) -> int:
        return self.topology.coord(self.rank).dp

    @property
    def tp_rank(self) -> int:
        return self.topology.coord(self.rank).tp

    @property
    def pp_rank(self) -> int:
        return self.topology.coord(self.rank).pp

    @property
    def dp_world_size(self) -> int:
        return self.topology.dp

    @property
    def tp_world_size(self) -> int:
        return self.topology.tp

    @property
    def pp_world_size(self) -> int:
        return self.topology.pp

    @property
    def pp_is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last_stage(self) -> bool:
        return self.pp_rank == self.topology.pp - 1
