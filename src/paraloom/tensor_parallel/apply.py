"""apply_tensor_parallel: split a paraloom GPT (or a pipeline stage of it) by its tp plan; full state dicts.

Composition (Shoeybi et al. 2019, figure 3), per block: attention qkv column-parallel by heads ->
local attention -> proj row-parallel (one all-reduce), MLP fc column-parallel -> GELU -> proj
row-parallel (one all-reduce); 2 all-reduces forward and 2 backward. The token embedding is
vocabulary-parallel; the head's output layer is column-parallel over the vocabulary and returns
vocabulary-parallel logits for `tp_loss`. Layer norms, biases after a reduce and the position
embedding stay replicated (their gradients come out equal on every rank). All of it is the GPT's
`TP_PLAN` (models/gpt.py), run by `apply_tp_plan` like any user's plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraloom.models.gpt import TP_PLAN
from paraloom.tensor_parallel.layers import PARALLEL_LAYERS, vocab_parallel_cross_entropy
from paraloom.tensor_parallel.layouts import hooks_of
from paraloom.tensor_parallel.mappings import group_size
from paraloom.tensor_parallel.module_plan import apply_tp_plan, is_tp_sharded

if TYPE_CHECKING:
    from paraloom.trace.timeline import Timeline


def apply_tensor_parallel(module: nn.Module, tp_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Rewrite in place every GPT Embedding, Block and Head in `module` to hold this rank's shard.

    Works on the whole GPT and on any slice of it (a pipeline stage): `apply_tp_plan` with the GPT's
    `TP_PLAN`, not strict; every rank takes the tp group's first rank's weights. Refuses a model split
    already. Returns `module`.
    """
    return apply_tp_plan(module, getattr(module, "tp_plan", TP_PLAN), tp_group, strict=False)


def trace_tensor_parallel(module: nn.Module, timeline: Timeline | None) -> int:
    """Make every tensor-parallel layer in `module`, and every layout or sequence-parallel hook a tp plan
    put on a module, record its collectives on `timeline` (lane "tp"), forward and backward, while the
    timeline is active; None detaches. Returns how many layers and hooks."""
    traced = [m for m in module.modules() if isinstance(m, PARALLEL_LAYERS)]
    traced += [hook for m in module.modules() for hook in hooks_of(m)]
    for item in traced:
        item.timeline = timeline
    return len(traced)


def tp_loss(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None = None,
            timeline: Timeline | None = None, *, smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of logits (B, C) or (B, T, V) against targets (B,) or (B, T): of
    vocabulary-parallel logits (a column-parallel layer left them split, `is_tp_sharded`) over
    `group`, of whole logits as `F.cross_entropy` on them flattened. `timeline` records the
    collectives (lane "tp") while active. `smoothing`: label smoothing, as `F.cross_entropy`'s.
    """
    if not is_tp_sharded(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               label_smoothing=smoothing)
    return vocab_parallel_cross_entropy(logits, targets, group, timeline, smoothing=smoothing)


def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters tensor parallelism split (each rank of the tp group holds a slice), in order."""
    layers = [m for m in module.modules() if isinstance(m, PARALLEL_LAYERS)]
    return [getattr(layer, leaf) for layer in layers for leaf in layer.sharded]


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _gather_shard(shard: torch.Tensor, index: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    shards = [torch.empty_like(shard) for _ in range(size)]
    indices = [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    dist.all_gather(indices, index, group=group)
    shape = list(shard.shape)
    shape[dim] *= size
    full = shard.new_empty(shape)
    return full.index_copy_(dim, torch.cat(indices).to(shard.device), torch.cat(shards, dim=dim))


@torch.no_grad()
def full_state_dict(module: nn.Module, tp_group: dist.ProcessGroup | None = None, *,
                    state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The unsplit state dict of a tensor-parallel `module` (collective over `tp_group`, on every rank).

    Keys and shapes match those of the module before `apply_tensor_parallel` / `apply_tp_plan`.
    `state`: this rank's slices as plain tensors where `module.state_dict()` does not give them so (a
    fully sharded module's, gathered over its data-parallel ranks first).
    """
    layers = {name: m for name, m in module.named_modules() if isinstance(m, PARALLEL_LAYERS)}
    out = {}
    for key, value in (module.state_dict() if state is None else state).items():
        prefix, _, leaf = key.rpartition(".")
        layer = layers.get(prefix)
        if layer is None or leaf not in layer.sharded or group_size(tp_group) == 1:
            out[key] = value.detach().clone()
        else:
            out[key] = _gather_shard(value.detach(), layer.full_index, layer.sharded[leaf], tp_group)
    return out


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsplit state dict (as `full_state_dict` returns) into a tensor-parallel `module`."""
    layers = {name: m for name, m in module.named_modules() if isinstance(m, PARALLEL_LAYERS)}
    local = {}
    for key, value in state.items():
        prefix, _, leaf = key.rpartition(".")
        layer = layers.get(prefix)
        if layer is not None and leaf in layer.sharded:
            value = value.index_select(layer.sharded[leaf], layer.full_index.to(value.device))
        local[key] = value
    module.load_state_dict(local)
