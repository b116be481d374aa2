"""Activation layouts between tensor-parallel modules, changed at a module's boundary; sequence parallelism.

A tensor handed between modules is whole on every rank of the tp group (`"replicate"`), or each rank holds
its contiguous share of the last dimension (`"shard"`, a column-parallel layer's output) or of the
sequence dimension (`"sequence"`, Korthikanti et al. 2022). It is never a partial sum, in forward or in
backward: a layer that leaves partial sums (a row-parallel layer) reduces them before handing its output
on, and one that computes partial gradients of its input (a column-parallel layer) reduces those.
So a layout change is the plain all-gather (backward: keep this rank's slice) or split (backward:
all-gather), whichever module consumes the result.

`LayoutHooks` change a module's positional inputs and outputs on the way in and out (torch's
`PrepareModuleInput` / `PrepareModuleOutput`). `GradAllReduce` sums over the tp group the gradient of a
replicated parameter that meets only this rank's share of the sequence (a layer norm's under sequence
parallelism, torch's `SequenceParallel`). Both keep a `timeline` (None; set by `trace_tensor_parallel`),
and the module they act on lists them under `TP_HOOKS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.tensor_parallel.mappings import all_reduce, gather_from_region, scatter_to_region, timed

if TYPE_CHECKING:
    from paraloom.trace.timeline import Timeline

LAYOUTS = ("replicate", "shard", "sequence")
TP_HOOKS = "_paraloom_tp_hooks"  # attribute of a module: the hooks a tp plan put on it
Layouts = tuple[tuple[str, str] | None, ...]  # per positional tensor: (layout it has, layout wanted), or None


def _dim(layout: str, sequence_dim: int) -> int:
    return -1 if layout == "shard" else sequence_dim


def relayout(x: torch.Tensor, have: str, want: str, group: dist.ProcessGroup | None, *, sequence_dim: int = 1,
             timeline: Timeline | None = None) -> torch.Tensor:
    """`x` in layout `have` (one of LAYOUTS) handed on in layout `want`: an all-gather to replicate, a split
    from it, both between shard and sequence (through replicate: no all-to-all)."""
    if have == want:
        return x
    if have != "replicate":
        x = gather_from_region(x, group, timeline, dim=_dim(have, sequence_dim))
    if want != "replicate":
        x = scatter_to_region(x, group, timeline, dim=_dim(want, sequence_dim))
    return x


def hooks_of(module: nn.Module) -> list[Any]:
    """The hooks a tp plan put on `module` (none: an empty list)."""
    return getattr(module, TP_HOOKS, [])


class LayoutHooks:
    """Forward pre-hook and forward hook of one module: its first positional inputs and its outputs (a
    tensor or a tuple of them) change layout as `inputs` and `outputs` say; None leaves one alone."""

    def __init__(self, name: str, group: dist.ProcessGroup | None, inputs: Layouts, outputs: Layouts,
                 sequence_dim: int) -> None:
        self.name, self.group, self.sequence_dim = name, group, sequence_dim
        self.inputs, self.outputs = inputs, outputs
        self.timeline: Timeline | None = None

    def _apply(self, values: tuple, layouts: Layouts, what: str) -> tuple:
        if len(values) < len(layouts):
            raise ValueError(f"module {self.name!r}: its tp_plan entry lays out {len(layouts)} {what}s and "
                             f"it has {len(values)} here; give one layout (or null) per positional {what}")
        out = list(values)
        for i, pair in enumerate(layouts):
            if pair is None:
                continue
            if not isinstance(values[i], torch.Tensor):
                raise ValueError(f"module {self.name!r}'s {what} {i} is a {type(values[i]).__name__}, not a "
                                 f"tensor; give its layout as null in the tp_plan entry")
            out[i] = relayout(values[i], *pair, self.group, sequence_dim=self.sequence_dim,
                              timeline=self.timeline)
        return tuple(out)

    def before(self, module: nn.Module, args: tuple) -> tuple:
        return self._apply(args, self.inputs, "input")

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return self._apply(output, self.outputs, "output")
        return self._apply((output,), self.outputs, "output")[0]

    def attach(self, module: nn.Module) -> None:
        if self.inputs:
            module.register_forward_pre_hook(self.before)
        if self.outputs:
            module.register_forward_hook(self.after)
        _record(module, self)


class GradAllReduce:
    """Tensor hook of a replicated parameter used on a share of the sequence: its gradient summed over
    the tp group before it is accumulated, so every rank holds the whole one."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.timeline: Timeline | None = None

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        name = "all_reduce sequence-parallel grad backward"
        return timed(self.timeline, name, all_reduce, grad, self.group)

    def attach(self, module: nn.Module) -> None:
        """Hook every parameter of `module` that trains (none: a dropout has nothing to sum)."""
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self)
        _record(module, self)


def _record(module: nn.Module, hook: LayoutHooks | GradAllReduce) -> None:
    setattr(module, TP_HOOKS, [*hooks_of(module), hook])
