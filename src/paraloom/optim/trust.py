"""Layer-wise trust ratios (LARS, LAMB) over whole tensors, also when a tensor is spread over ranks.

A trust ratio scales each parameter tensor's update by a ratio of two norms of that *whole*
tensor. Under a sharded optimizer (ZeRO, data_parallel/sharded_optimizer.py) a rank steps one contiguous
block of a flat buffer that concatenates several tensors, and a tensor may straddle two ranks'
blocks; under tensor parallelism a rank holds a slice of a tensor. `set_segments` tells the
optimizer which whole tensor each element belongs to and over which process group the other
pieces live: squared norms are summed per segment with `index_add_`, all-reduced (SUM) over the
group, and each element takes its segment's ratio. A DTensor parameter (fully sharded data
parallelism) is one segment whose other pieces live on its mesh's sharding group: its local shard's
sums are all-reduced there, and its ratio is a replicated DTensor; a DTensor sharding a tensor-parallel
slice (`set_segments(p, group=tp_group)`) sums over its sharding group, then over the slice's group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

RatioFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Segments(NamedTuple):
    ids: torch.Tensor | None  # (numel,) long: element i belongs to whole tensor ids[i]; None: one segment
    count: int  # number of segments
    group: dist.ProcessGroup | None  # where the rest of each segment lives; None: nowhere (local sums)
    also: dist.ProcessGroup | None = None  # summed over after `group`: a fully sharded tp slice's tp group


class TrustRatioOptimizer(torch.optim.Optimizer):
    """An optimizer whose per-tensor trust ratios may span elements of several ranks (`set_segments`)."""

    def __init__(self, params, defaults: dict) -> None:
        super().__init__(params, defaults)
        self._segments: dict[torch.Tensor, Segments] = {}  # topology, not state: not in state_dict

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_segments", {})

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group's parameters that have a gradient (`_step_group`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def set_segments(self, param: torch.Tensor, segment_ids: torch.Tensor | None = None,
                     n_segments: int = 1, group: dist.ProcessGroup | None = None) -> None:
        """Compute `param`'s trust ratios per whole tensor ("segment") rather than per `param`.

        `segment_ids` (long, one entry per element of `param`): element i belongs to segment
        `segment_ids[i]` in `[0, n_segments)`; None means all of `param` is one segment (a
        tensor-parallel slice). The segments' squared norms are all-reduced (SUM) over `group`,
        so every rank of `group` must call `step()` together, with its segmented parameters in
        the same order and the same `n_segments`. `group=None` means *no* communication (the
        whole tensors are all here, e.g. one flat buffer of several tensors) -- not torch's
        default group: pass `dist.group.WORLD` for that. Padding elements may take any segment,
        e.g. an extra one; zeros change no norm. `set_segments(param)` restores the default
        (the parameter is one whole tensor). Segments are not part of `state_dict`: set them
        again after building the optimizer.
        """
        if not any(param is q for g in self.param_groups for q in g["params"]):
            raise ValueError("set_segments: the tensor is not a parameter of this optimizer")
        if n_segments < 1:
            raise ValueError(f"set_segments: n_segments={n_segments} must be at least 1")
        if segment_ids is None:
            if n_segments != 1:
                raise ValueError(f"set_segments: without segment_ids there is one segment, not {n_segments}")
            if group is None:
                self._segments.pop(param, None)
            else:
                self._segments[param] = Segments(None, 1, group)
            return
        ids = segment_ids.to(device=param.device, dtype=torch.long).reshape(-1)
        if ids.numel() != param.numel():
            raise ValueError(f"set_segments: {ids.numel()} segment ids for a parameter of "
                             f"{param.numel()} elements")
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n_segments):
            raise ValueError(f"set_segments: segment ids must lie in [0, {n_segments})")
        self._segments[param] = Segments(ids, n_segments, group)

    def _trust_ratios(self, params: list[torch.Tensor], xs: list[torch.Tensor], ys: list[torch.Tensor],
                      ratio: RatioFn) -> list[torch.Tensor]:
        """`ratio(||x||, ||y||)` per whole tensor, shaped to multiply each parameter's update.

        `ratio` gets two 1-d tensors of norms (all segments of all `params` at once) and returns
        one ratio each. A parameter without segments gets a 0-d ratio, one with segments a ratio
        per element.
        """
        x_norms: list = [None] * len(params)
        y_norms: list = [None] * len(params)
        plain = [i for i, p in enumerate(params) if self._segment_of(p) is None]
        if plain:
            xn = torch._foreach_norm([xs[i] for i in plain])
            yn = torch._foreach_norm([ys[i] for i in plain])
            for i, a, b in zip(plain, xn, yn, strict=True):
                x_norms[i], y_norms[i] = a.reshape(1), b.reshape(1)
        self._segment_norms(params, xs, ys, x_norms, y_norms)
        ratios = ratio(torch.cat(x_norms), torch.cat(y_norms)).split([n.numel() for n in x_norms])
        return [self._spread(p, r) for p, r in zip(params, ratios, strict=True)]

    def _segment_norms(self, params, xs, ys, x_norms: list, y_norms: list) -> None:
        """Fill in the norms of segmented parameters: one all-reduce per (group, device)."""
        batches: dict[tuple[int, int, torch.device], tuple[Segments, list]] = {}
        for i, p in enumerate(params):
            seg = self._segment_of(p)
            if seg is not None:
                sums = _square_sums(_local(xs[i]), _local(ys[i]), seg)
                batches.setdefault((id(seg.group), id(seg.also), p.device), (seg, []))[1].append((i, sums))
        for seg, items in batches.values():  # insertion order: the same on every rank
            flat = torch.cat([s.reshape(-1) for _, s in items])
            for group in (seg.group, seg.also):
                if group is not None:
                    dist.all_reduce(flat, group=group)
            parts = flat.sqrt_().split([s.numel() for _, s in items])
            for (i, _), part in zip(items, parts, strict=True):
                x_norms[i], y_norms[i] = part.view(2, -1).unbind(0)

    def _segment_of(self, param: torch.Tensor) -> Segments | None:
        """`param`'s segments: as `set_segments` set them, a DTensor's sharding group (then the group
        `set_segments` named, where it named one), else None."""
        seg = self._segments.get(param)
        if isinstance(param, DTensor) and (seg is None or seg.ids is None):
            dims = [d for d, placement in enumerate(param.placements) if placement.is_shard()]
            if len(dims) > 1:
                raise ValueError(f"a trust ratio over a DTensor sharded on {len(dims)} mesh dimensions")
            also = seg.group if seg is not None else None
            if dims:
                seg = Segments(None, 1, param.device_mesh.get_group(dims[0]), also)
        return seg

    def _spread(self, param: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
        seg = self._segments.get(param)
        if isinstance(param, DTensor) and (seg is None or seg.ids is None):  # one ratio, on every rank
            return DTensor.from_local(ratio.reshape(()), param.device_mesh,
                                      [Replicate()] * param.device_mesh.ndim, run_check=False)
        if seg is None or seg.ids is None:
            return ratio.reshape(())
        return ratio[seg.ids].view_as(param)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _square_sums(x: torch.Tensor, y: torch.Tensor, seg: Segments) -> torch.Tensor:
    """(2, count): this rank's sums of x**2 and y**2 per segment, in at least float32."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    squares = torch.stack([x.detach().reshape(-1), y.reshape(-1)]).to(dtype).square_()
    if seg.ids is None:
        return squares.sum(dim=1, keepdim=True)
    return torch.zeros(2, seg.count, dtype=dtype, device=x.device).index_add_(1, seg.ids, squares)


def where_both_positive(a: torch.Tensor, b: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` where both norms are positive, else 1 (a zero tensor or a zero update keeps its rate)."""
    return torch.where((a > 0) & (b > 0), value, torch.ones_like(value))
