"""Fully sharded data parallelism (ZeRO-2/3, FSDP's SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD) on torch's
`fully_shard`: which modules become units, the mesh a level shards over, prefetch, and what a rank holds.

`parallel.shard` levels and what they shard (P parameters, G gradients, O optimizer state):

  level       ZeRO / FSDP                      at rest            during a step
  optimizer   ZeRO-1                           O/n                P + G whole (the engine's, data_parallel/)
  gradients   ZeRO-2, FSDP SHARD_GRAD_OP       P/n, G/n, O/n      each unit's P stays gathered from its
                                                                  forward to its backward
  full        ZeRO-3, FSDP FULL_SHARD          P/n, G/n, O/n      a unit's P gathered for its forward,
                                                                  freed, gathered again for its backward
  hybrid      FSDP HYBRID_SHARD                P/s, G/s, O/s      as full inside a group of s ranks (a
                                                                  node), gradients all-reduced across groups

The model is sharded unit by unit (`find_units`): each unit's parameters are one all-gather before
its forward and one reduce-scatter after its backward; the root holds what no unit does (an
embedding tied to the head, a final norm). While unit i computes, the gather of the next
`prefetch` units is already issued (forward in module order, backward in reverse). Gradient
accumulation defers the reduce-scatter to the last micro-batch (`no_sync`-like,
`set_requires_gradient_sync(False)`), as torch's FSDP and DDP do.

Why torch's `fully_shard` rather than an engine of paraloom's own: DESIGN.md §1's "build on torch where
torch is good" — it is DTensor-native (so DCP reshards its checkpoints, clipping and optimizers
see ordinary parameters), it runs on gloo and NCCL alike, and its per-unit gathers, reduce-scatters,
prefetch and mixed precision are what the issue asks for; benchmarks/sharding.py measures the wrapper
against a bare `fully_shard` loop in the same run.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from paraloom.comm.collectives import CommStats, broadcast_coalesced
from paraloom.config.choices import FULLY_SHARDED
from paraloom.config.errors import UserError
from paraloom.trace import Timeline

try:  # torch >= 2.6 exports fully_shard here; 2.4 and 2.5 under _composable
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
try:  # the interfaces FSDPModule.set_custom_all_gather / set_custom_reduce_scatter take (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: the collectives are not counted one by one
    AllGather = ReduceScatter = None

# torch 2.13 renamed the flat collectives (the old names warn); releases before have only the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- units --------------------------------------------------------------------------------------------

def find_units(model: nn.Module, spec: str = "auto") -> list[tuple[str, nn.Module]]:
    """The modules of `model` sharded as units, (name, module) in module order, by `spec`:

    "auto": the classes the model names in its `shard_units` attribute (the zoo: the GPT's and BERT's
        blocks, ResNet's residual blocks, VGG's stages), else the children of the model's largest
        container whose items share one class (a user's list of transformer blocks), else none (the
        whole model is one unit);
    "size:MB": bottom-up, a module becomes a unit once the parameters under it that no unit holds
        yet reach MB megabytes (FSDP1's size-based wrapping);
    otherwise a comma-separated list of module classes (`Block`) and name patterns (`layers.*`,
        fnmatch); an item that matches nothing is refused.

    A module whose parameters are also used outside it (an embedding tied to the output layer) is
    never a unit: the root holds it, so both users see one gathered tensor.
    """
    spec = spec.strip()
    named = [(name, m) for name, m in model.named_modules() if name]
    if spec == "auto":
        classes = getattr(model, "shard_units", None)
        chosen = [(n, m) for n, m in named if type(m).__name__ in classes] if classes else _repeated(model)
    elif spec.startswith("size:"):
        chosen = _by_size(model, _megabytes(spec))
    else:
        chosen = []
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            hits = [(n, m) for n, m in named if type(m).__name__ == item or fnmatch.fnmatchcase(n, item)]
            if not hits:
                kinds = sorted({type(m).__name__ for _, m in named})
                raise UserError(f"parallel.shard_units item {item!r} matches no module of the model; its "
                                f"module classes: {', '.join(kinds)}")
            chosen += [hit for hit in hits if hit not in chosen]
        order = {name: i for i, (name, _) in enumerate(named)}
        chosen.sort(key=lambda item: order[item[0]])
    return [(n, m) for n, m in chosen if not _shares_parameters(model, m) and _has_parameters(m)]


def _repeated(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The items of the model's container with most parameters whose children are of one class (>= 2)."""
    best: list[tuple[str, nn.Module]] = []
    best_size = 0
    for name, module in [("", model), *model.named_modules()]:
        children = list(module.named_children())
        if len(children) < 2:
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in children:
            if _has_parameters(child):
                full_name = f"{name}.{child_name}" if name else child_name
                by_class.setdefault(type(child), []).append((full_name, child))
        for items in by_class.values():
            size = sum(p.numel() for _, m in items for p in m.parameters())
            if len(items) >= 2 and size > best_size and type(items[0][1]) not in _LEAVES:
                best, best_size = items, size
    return best


# layers too small to be units on their own: a run of them is a model's body, not its blocks
_LEAVES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.BatchNorm1d,
           nn.BatchNorm2d)


def _by_size(model: nn.Module, megabytes: float) -> list[tuple[str, nn.Module]]:
    limit, claimed, chosen = megabytes * 2**20, set(), []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if not name:
            return  # the root is always sharded, as the last unit
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() * p.element_size() for p in free) >= limit:
            claimed.update(id(p) for p in free)
            chosen.append((name, module))

    visit("", model)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=lambda item: order[item[0]])


def _megabytes(spec: str) -> float:
    try:
        value = float(spec.removeprefix("size:"))
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UserError(f"parallel.shard_units={spec!r}: give a positive size in MB, as size:25")
    return value


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shares_parameters(model: nn.Module, unit: nn.Module) -> bool:
    inside = {id(p) for p in unit.parameters()}
    unit_modules = {id(m) for m in unit.modules()}
    for module in model.modules():
        if id(module) in unit_modules:
            continue
        if any(id(p) in inside for p in module.parameters(recurse=False)):
            return True
    return False


# ---- the mesh and the wrapping ------------------------------------------------------------------------

def shard_mesh(level: str, *, world_size: int, group_size: int, device_type: str, tp: int = 1,
               pp: int = 1) -> DeviceMesh:
    """The device mesh `level` shards over: one dimension "shard" of the `world_size` data-parallel
    ranks; for hybrid, ranks in groups of `group_size` consecutive ones (a node's), dims ("replicate",
    "shard"). With `tp` > 1 a last dimension "tp" of consecutive ranks, whose groups split each layer
    by its tensor-parallel plan; with `pp` > 1 a first dimension "pp", one pipeline stage each
    (paraloom's Topology: rank = (pp x dp + dp) x tp + tp). `data_mesh` is what fully_shard shards
    over: the data-parallel dimensions alone."""
    head, head_names = ((pp,), ("pp",)) if pp > 1 else ((), ())
    tail, tail_names = ((tp,), ("tp",)) if tp > 1 else ((), ())
    if level != "hybrid":
        return init_device_mesh(device_type, (*head, world_size, *tail),
                                mesh_dim_names=(*head_names, "shard", *tail_names))
    if group_size < 1 or world_size % group_size:
        raise UserError(f"parallel.shard=hybrid shards inside groups of parallel.shard_group={group_size} "
                        f"ranks, which must divide the {world_size} data-parallel ranks")
    return init_device_mesh(device_type, (*head, world_size // group_size, group_size, *tail),
                            mesh_dim_names=(*head_names, "replicate", "shard", *tail_names))


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions of `shard_mesh`'s mesh that fully_shard shards (and hybrid replicates) over."""
    names = [name for name in mesh.mesh_dim_names if name not in ("tp", "pp")]
    return mesh if len(names) == mesh.ndim else mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def apply_sharding(model: nn.Module, units: list[tuple[str, nn.Module]], mesh: DeviceMesh, *, level: str,
                   reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                   reduce_dtype: torch.dtype | None = None, prefetch: int = 1) -> nn.Module:
    """`fully_shard` every unit (innermost first), then the root; set explicit prefetch of the next
    `prefetch` units in forward and the previous ones in backward. `level` gradients keeps every
    unit gathered from forward to backward (`reshard_after_forward` is then False)."""
    if level not in FULLY_SHARDED:
        raise ValueError(f"apply_sharding shards at {', '.join(FULLY_SHARDED)}, not {level!r}")
    reshard = reshard_after_forward and level != "gradients"
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    depth = {name: name.count(".") for name, _ in units}
    for _, unit in sorted(units, key=lambda item: -depth[item[0]]):  # nested units before their parents
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # the root's output in fp32: the loss is computed as autocast would compute it
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                       output_dtype=torch.float32 if param_dtype is not None else None)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=root_policy)
    outer = [unit for name, unit in units if not any(name.startswith(f"{other}.") for other, _ in units)]
    if prefetch > 0 and len(outer) > 1:
        for i, unit in enumerate(outer):
            ahead, behind = outer[i + 1:i + 1 + prefetch], outer[max(0, i - prefetch):i][::-1]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
            if behind:
                unit.set_modules_to_backward_prefetch(behind)
    return model


def count_collectives(units: list[tuple[str, nn.Module]], root: nn.Module, stats: CommStats,
                      timeline: Timeline | None) -> bool:
    """Have every unit's (and the root's) all-gathers and reduce-scatters counted in `stats` (the
    bytes this rank hands to them) and, on `timeline`, drawn as spans "all-gather NAME" and
    "reduce-scatter NAME" on lane "comm", from issue to completion. False where torch offers no
    such hook (torch < 2.8): nothing is counted then."""
    if AllGather is None or not hasattr(root, "set_custom_all_gather"):
        return False
    for name, module in [*units, ("(root)", root)]:
        module.set_custom_all_gather(_CountedAllGather(name, stats, timeline))
        module.set_custom_reduce_scatter(_CountedReduceScatter(name, stats, timeline))
    return True


class _Counted:
    """What the counted all-gather and reduce-scatter share: a buffer as torch's default allocates
    it, the byte count, and a span that ends when the collective completes (gloo's completion
    callback only notes the time: it issues nothing, DESIGN.md §3)."""

    kind = ""

    def __init__(self, name: str, stats: CommStats, timeline: Timeline | None) -> None:
        self.name, self.stats, self.timeline = name, stats, timeline

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _issued(self, payload: torch.Tensor, work: Any, start: float) -> Any:
        self.stats.add(payload.numel() * payload.element_size(), 0.0)
        timeline = self.timeline
        if timeline is not None and timeline.active:
            label = f"{self.kind} {self.name}"
            if work is None:
                timeline.span(label, "comm", start, timeline.now())
            else:
                work.get_future().then(lambda _: timeline.span(label, "comm", start, timeline.now()))
        return work


class _CountedAllGather(_Counted, *((AllGather,) if AllGather is not None else ())):
    kind = "all-gather"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        start = time.perf_counter()
        work = _all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)
        return self._issued(input_tensor, work, start)


class _CountedReduceScatter(_Counted, *((ReduceScatter,) if ReduceScatter is not None else ())):
    kind = "reduce-scatter"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        start = time.perf_counter()
        work = _reduce_scatter_flat(output=output_tensor, input=input_tensor, op=op, group=group,
                                    async_op=async_op)
        return self._issued(input_tensor, work, start)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether this backward reduce-scatters (False on the micro-batches before an accumulation's last)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled, recurse=True)


def group_over(mesh: DeviceMesh, names: list[str]) -> dist.ProcessGroup:
    """The group of this rank's ranks that differ only along the mesh dimensions `names` (collective:
    every rank of the mesh calls it alike)."""
    if len(names) == 1:
        return mesh.get_group(names[0])
    if len(names) == mesh.ndim:
        return dist.group.WORLD  # the mesh is the world's (shard_mesh)
    along = [mesh.mesh_dim_names.index(name) for name in names]
    rest = [d for d in range(mesh.ndim) if d not in along]
    rows = mesh.mesh.permute(*rest, *along).reshape(-1, math.prod(mesh.size(d) for d in along))
    group, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in rows])
    return group


def data_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The data-parallel ranks of this rank's tp slice and pipeline stage: with hybrid the replicas'
    too (collective)."""
    return group_over(mesh, [name for name in mesh.mesh_dim_names if name in ("replicate", "shard")])


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks that together hold the model once (a norm over the shards is summed over these): a
    sharding group's, with tensor parallelism its tp groups' and with pipeline parallelism every
    stage's too (collective: every rank calls it)."""
    return group_over(mesh, [name for name in mesh.mesh_dim_names if name != "replicate"])


@torch.no_grad()
def broadcast_from_first(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's parameters and buffers become the group's first rank's (DDP's constructor does the
    same), one broadcast per dtype: a model built without a seed would otherwise shard different
    weights on each rank."""
    if dist.get_world_size(group) > 1:
        broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), group)


# ---- what a rank holds ----------------------------------------------------------------------------------

def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor whole."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(params: Iterable[torch.Tensor],
               optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards, or whole
    tensors), as {"params", "grads", "optimizer"}."""
    params = list(params)
    out = {"params": sum(_nbytes(local(p)) for p in params),
           "grads": sum(_nbytes(local(p.grad)) for p in params if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(_nbytes(local(v)) for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of `optimizer`'s parameters in the order its `state_dict()` numbers them: how a
    state keyed by number (torch's format) and one keyed by name (a fully sharded run's, through
    `torch.distributed.checkpoint.state_dict`) are turned into each other."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def describe(units: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """The units for a run's summary: how many, and the first few names."""
    return {"count": len(units), "names": [name for name, _ in units[:6]]}
