"""DataParallel's constructor: torch DDP's arguments in the installed torch's own order, beside paraloom's.

`DataParallel(module, *ddp_args, <paraloom's options>, **ddp_kwargs)`: paraloom's options are
keywords of its own signature; DDP's arguments are bound here against
`DistributedDataParallel.__init__` of the torch at hand (`bind`), so a script that passes them
positionally or by name keeps working under any torch paraloom supports, and an unknown one is
refused as torch refuses it. What each DDP argument means here (`resolve`):

- module, process_group (or device_mesh, 1-D), bucket_cap_mb, init_sync, broadcast_buffers /
  forward_sync_buffers, device_ids: as in DDP.
- output_device, dim: DDP's single-process multi-device mode, which DDP itself no longer runs;
  one process drives one device here, so they change nothing.
- find_unused_parameters: as in DDP, a parameter that no rank used keeps its gradient (None stays
  None, so AdamW skips it; data_parallel/unused.py). Without it, a parameter that got no gradient
  counts as zero in the average (where DDP would stop with an error at the next step).
- static_graph, gradient_as_bucket_view, check_reduction, batched_grad_copy,
  skip_all_reduce_unused_params: the engine always averages every bucket and its gradients always
  are views of the buckets (no copy), so these ask for nothing it does not do.
- delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, bucket_cap_mb_list:
  not built; refused with one line rather than ignored.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from paraloom.config import CommConfig

DEFAULTS = CommConfig()  # the defaults of DataParallel's own keyword options (comm.* config keys)
ENGINE_OPTIONS = ("bucket_mb", "first_bucket_mb", "scheduler", "algorithm", "sync", "local_steps",
                  "local_warmup", "shard_optimizer", "partition_mb", "credit_mb", "delay_lr", "compressor")
_REFUSED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
            "bucket_cap_mb_list")
# DDP's own arguments, self and module first, as the installed torch names and orders them
DDP_SIGNATURE = inspect.signature(DistributedDataParallel.__init__)


def bind(module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """DDP's arguments by name, defaults filled in, as `DataParallel(module, *args, **kwargs)` gave
    them (paraloom's own options aside); an unknown or doubled one is torch's TypeError."""
    bound = DDP_SIGNATURE.bind(None, module, *args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    del given["self"]
    return given


def resolve(given: dict[str, Any], *, group=None,
            bucket_mb: float | str = DEFAULTS.bucket_mb) -> dict[str, Any]:
    """DDP's arguments (`bind`) turned into the engine's settings: group, bucket_mb, init_sync, buffer
    syncs; `group` and `bucket_mb` are paraloom's names for DDP's process_group and bucket_cap_mb."""
    for name in _REFUSED:
        if given.get(name) is not None:
            raise ValueError(f"DataParallel does not implement DDP's {name}=; leave it unset")
    device_ids = given.get("device_ids")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids={list(device_ids)}: one process drives one device, as DDP requires "
                         "today; give one device id (or none for a CPU module)")
    if device_ids:
        first = device_ids[0]
        want = torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
        have = next((p.device for p in given["module"].parameters()), want)
        if have != want:
            raise ValueError(f"device_ids={list(device_ids)} but the module's parameters are on {have}: "
                             "move the module to that device first (module.to(device)), as DDP requires")
    ddp_group = given.get("process_group")
    mesh = given.get("device_mesh")
    if mesh is not None:
        if ddp_group is not None:
            raise ValueError("give process_group= or device_mesh=, not both")
        if mesh.ndim != 1:
            raise ValueError(f"device_mesh must be 1-D for data parallelism, got {mesh.ndim}-D")
        ddp_group = mesh.get_group()
    if group is not None:
        if ddp_group is not None:
            raise ValueError("give group= or process_group=, not both (they are the same thing)")
        ddp_group = group
    if given.get("bucket_cap_mb") is not None:
        if bucket_mb != DEFAULTS.bucket_mb:
            raise ValueError("give bucket_cap_mb= or bucket_mb=, not both (they are the same thing)")
        bucket_mb = float(given["bucket_cap_mb"])
    broadcast, forward = given.get("broadcast_buffers"), given.get("forward_sync_buffers")
    if forward is not None:  # DDP: the newer flag wins; buffers are always synced at init
        init_buffers = True
    else:
        forward = init_buffers = broadcast if broadcast is not None else True
    return {"group": ddp_group, "bucket_mb": bucket_mb, "init_sync": bool(given.get("init_sync", True)),
            "forward_sync_buffers": bool(forward), "init_sync_buffers": bool(init_buffers),
            "device_ids": list(device_ids) if device_ids is not None else None}


def engine_options(comm, compressor_options: dict | None, **options) -> dict[str, Any]:
    """The engine's comm.* options (`ENGINE_OPTIONS`): from `comm=` (a CommConfig) or the keywords,
    never both; `compressor_options` join the config's."""
    extra = dict(compressor_options or {})
    if comm is not None:
        set_too = sorted(k for k, v in options.items() if v != getattr(DEFAULTS, k))
        if set_too:
            raise TypeError(f"give engine options in comm= or as keywords, not both: {set_too}")
        options = {name: getattr(comm, name) for name in ENGINE_OPTIONS}
        extra = {**comm.compressor_options(), **extra}
    options["compressor"] = options["compressor"] or "none"
    options["compressor_options"] = extra
    return options


def data_parallel_group(topology, group):
    """The group from `topology` (a Topology, whose groups are made now, or its RankGroups) or `group`."""
    if topology is None:
        return group
    if group is not None:
        raise TypeError("give group= (or process_group=) or topology=, not both")
    groups = topology.init_groups() if hasattr(topology, "init_groups") else topology
    return groups.dp_group
