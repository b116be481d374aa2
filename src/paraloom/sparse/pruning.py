"""Magnitude pruning with plain bool masks we own, kept identical on every data-parallel rank."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.config.choices import PRUNING_SCOPES
from paraloom.config.errors import UserError
from paraloom.sparse.sparsity_schedule import SparsitySchedule


def default_targets(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The `weight` of every nn.Linear and nn.Conv2d (no biases, embeddings or norms), each once."""
    seen: set[int] = set()
    out = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append((f"{name}.weight" if name else "weight", module.weight))
    return out


def count_pruned(n: int, sparsity: float) -> int:
    """round(sparsity * n), rounding halves up, so n elements at `sparsity` keep all but that many."""
    return min(n, math.floor(sparsity * n + 0.5))


def lowest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k smallest of a flat `scores`; ties go to the lower index (stable sort)."""
    return torch.sort(scores, stable=True).indices[:k]


def prune_unstructured(scores: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """A mask with at least k entries pruned: the already-pruned ones, then the lowest-scoring alive ones."""
    flat = scores.reshape(-1).masked_fill(~mask.reshape(-1), -math.inf)
    k = max(k, int((~mask).sum()))  # masks only shrink
    new = torch.ones(flat.numel(), dtype=torch.bool, device=mask.device)
    new[lowest(flat, k)] = False
    return new.view(mask.shape)


def prune_rows(weight: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Structured: prune whole output rows (Linear neurons, Conv2d channels) with the lowest L2 norms."""
    rows = weight.shape[0]
    norms = weight.detach().reshape(rows, -1).float().norm(dim=1)
    alive = mask.reshape(rows, -1).all(dim=1)
    keep = prune_unstructured(norms, alive, count_pruned(rows, sparsity))
    return keep.view(rows, *([1] * (weight.dim() - 1))).expand(weight.shape).clone()


class MagnitudePruner:
    """Zero the smallest-magnitude weights of `targets` on the schedule; masks are bool tensors by name.

    scope="layer" prunes each tensor to the target sparsity; scope="global" ranks all targets
    together under one threshold; structured=True prunes whole output rows/channels per layer by
    L2 norm. `group` is the group over which the model is replicated (the data-parallel group):
    rank 0 of it decides the masks. Parameters stay plain nn.Parameters (no reparametrization):
    call `mask_gradients()` before and `apply()` after every optimizer step, or momentum and
    Adam revive pruned weights.
    """

    def __init__(self, model: nn.Module, schedule: SparsitySchedule, *, scope: str = "layer",
                 structured: bool = False, group: Any = None,
                 targets: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        if scope not in PRUNING_SCOPES:
            raise UserError(f"pruning scope={scope!r} is unknown; choose one of {', '.join(PRUNING_SCOPES)}")
        if structured and scope == "global":
            raise UserError("structured pruning ranks rows within each layer; use scope='layer'")
        self.targets: dict[str, torch.Tensor] = {}
        for name, param in default_targets(model) if targets is None else targets:
            if name in self.targets:
                raise UserError(f"pruning target {name!r} is listed twice; name each parameter once")
            self.targets[name] = param
        if not self.targets:
            raise UserError("nothing to prune: the model has no nn.Linear or nn.Conv2d weights; "
                            "pass targets=[(name, parameter), ...]")
        self.schedule, self.scope, self.structured, self.group = schedule, scope, structured, group
        self.masks: dict[str, torch.Tensor] = {
            name: torch.ones_like(p, dtype=torch.bool) for name, p in self.targets.items()}
        self.last_step: int | None = None  # step of the last mask update (schedule progress)
        self.target_sparsity = 0.0  # sparsity asked for at that update

    # -- recomputing masks ------------------------------------------------------------------------
    def update(self, step: int) -> bool:
        """Recompute, synchronize and apply masks if the schedule is due at `step`; True if they changed."""
        if not self.schedule.due(step):
            return False
        sparsity = self.schedule.target(step)
        new = self._compute(sparsity)
        self._broadcast(new)
        changed = any(not torch.equal(new[n], self.masks[n]) for n in self.masks)
        self.masks = new
        self.last_step, self.target_sparsity = step, sparsity
        self.apply()
        return changed

    def _compute(self, sparsity: float) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            if self.structured:
                return {n: prune_rows(p, self.masks[n], sparsity) for n, p in self.targets.items()}
            if self.scope == "layer":
                return {n: prune_unstructured(p.detach().abs(), self.masks[n],
                                              count_pruned(p.numel(), sparsity))
                        for n, p in self.targets.items()}
            # global: one ranking over all targets (fp32 so mixed dtypes compare)
            device = next(iter(self.masks.values())).device
            scores = torch.cat([p.detach().abs().float().reshape(-1).to(device)
                                for p in self.targets.values()])
            masks = torch.cat([m.reshape(-1).to(device) for m in self.masks.values()])
            flat = prune_unstructured(scores, masks, count_pruned(scores.numel(), sparsity))
            out, offset = {}, 0
            for name, mask in self.masks.items():
                out[name] = flat[offset:offset + mask.numel()].view(mask.shape).to(mask.device)
                offset += mask.numel()
            return out

    def _broadcast(self, masks: dict[str, torch.Tensor]) -> None:
        """Overwrite `masks` in place with group rank 0's, as one flat uint8 buffer."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) < 2:
            return
        device = next(iter(masks.values())).device
        flat = torch.cat([m.reshape(-1).to(device, torch.uint8) for m in masks.values()])
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(flat, src=src, group=self.group)
        offset = 0
        for name, mask in masks.items():
            masks[name] = flat[offset:offset + mask.numel()].view(mask.shape).to(mask.device, torch.bool)
            offset += mask.numel()

    # -- enforcing masks --------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self) -> None:
        """Set pruned weights to exactly zero, in place."""
        for name, p in self.targets.items():
            p.masked_fill_(~self.masks[name], 0)

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Zero the gradients of pruned weights, in place (parameters without a gradient are skipped)."""
        for name, p in self.targets.items():
            if p.grad is not None:
                p.grad.masked_fill_(~self.masks[name], 0)

    # -- reporting --------------------------------------------------------------------------------
    def density(self) -> float:
        """Fraction of target weights kept."""
        kept = sum(int(m.sum()) for m in self.masks.values())
        return kept / sum(m.numel() for m in self.masks.values())

    def sparsity(self) -> float:
        """Fraction of target weights pruned."""
        return 1.0 - self.density()

    def layer_sparsity(self) -> dict[str, float]:
        """Fraction pruned, per target name."""
        return {n: 1.0 - int(m.sum()) / max(m.numel(), 1) for n, m in self.masks.items()}

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Masks (bool, CPU) by name and schedule progress; loads with torch.load(weights_only=True)."""
        return {"masks": {n: m.detach().cpu().clone() for n, m in self.masks.items()},
                "last_step": self.last_step, "target_sparsity": self.target_sparsity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore masks and progress from `state_dict()`, then zero the pruned weights."""
        masks = state["masks"]
        if set(masks) != set(self.masks):
            missing, extra = sorted(set(self.masks) - set(masks)), sorted(set(masks) - set(self.masks))
            raise UserError(f"pruning state does not match this model (missing {missing}, unexpected "
                            f"{extra}); load it into a pruner built over the same model and targets")
        for name, mask in masks.items():
            if mask.shape != self.masks[name].shape:
                raise UserError(f"pruning mask {name!r} has shape {tuple(mask.shape)} but the parameter "
                                f"has {tuple(self.masks[name].shape)}; was the model built differently?")
        self.masks = {n: masks[n].to(self.masks[n].device, torch.bool).clone() for n in self.masks}
        self.last_step, self.target_sparsity = state["last_step"], float(state["target_sparsity"])
        self.apply()
