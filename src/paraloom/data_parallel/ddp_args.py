"""DataParallel's constructor: torch DDP's arguments in the installed torch's own order, then paraloom's.

The signature is read from `DistributedDataParallel.__init__` of the torch at hand, so a script
that passes DDP's arguments positionally or by name keeps working under any torch paraloom
supports. What each DDP argument means here (`resolve`):

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

_D = CommConfig()
# paraloom's own options, keyword-only, after DDP's: the comm.* config keys and the engine's wiring
PARALOOM_OPTIONS: dict[str, Any] = {
    "group": None, "bucket_mb": _D.bucket_mb, "first_bucket_mb": _D.first_bucket_mb,
    "scheduler": _D.scheduler, "algorithm": _D.algorithm, "stats": None, "sync": _D.sync,
    "local_steps": _D.local_steps, "local_warmup": _D.local_warmup, "shard_optimizer": _D.shard_optimizer,
    "partition_mb": _D.partition_mb, "credit_mb": _D.credit_mb, "delay_lr": _D.delay_lr,
    "compressor": _D.compressor, "compressor_options": None, "timeline": None, "comm_group": None,
    "topology": None, "comm": None,
}
ENGINE_OPTIONS = ("bucket_mb", "first_bucket_mb", "scheduler", "algorithm", "sync", "local_steps",
                  "local_warmup", "shard_optimizer", "partition_mb", "credit_mb", "delay_lr", "compressor")
_REFUSED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
            "bucket_cap_mb_list")


def _signature() -> inspect.Signature:
    ddp = list(inspect.signature(DistributedDataParallel.__init__).parameters.values())
    own = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
           for name, default in PARALOOM_OPTIONS.items()]
    return inspect.Signature([*ddp, *own])


SIGNATURE = _signature()


def bind(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument by name, defaults filled in, as `DataParallel(*args, **kwargs)` gave them."""
    bound = SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def resolve(given: dict[str, Any]) -> dict[str, Any]:
    """DDP's arguments turned into the engine's settings: group, bucket_mb, init_sync, buffer syncs."""
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
    group = given.get("process_group")
    mesh = given.get("device_mesh")
    if mesh is not None:
        if group is not None:
            raise ValueError("give process_group= or device_mesh=, not both")
        if mesh.ndim != 1:
            raise ValueError(f"device_mesh must be 1-D for data parallelism, got {mesh.ndim}-D")
        group = mesh.get_group()
    if given.get("group") is not None:
        if group is not None:
            raise ValueError("give group= or process_group=, not both (they are the same thing)")
        group = given["group"]
    bucket_mb = given["bucket_mb"]
    if given.get("bucket_cap_mb") is not None:
        if bucket_mb != _D.bucket_mb:
            raise ValueError("give bucket_cap_mb= or bucket_mb=, not both (they are the same thing)")
        bucket_mb = float(given["bucket_cap_mb"])
    broadcast, forward = given.get("broadcast_buffers"), given.get("forward_sync_buffers")
    if forward is not None:  # DDP: the newer flag wins; buffers are always synced at init
        init_buffers = True
    else:
        forward = init_buffers = broadcast if broadcast is not None else True
    return {"group": group, "bucket_mb": bucket_mb, "init_sync": bool(given.get("init_sync", True)),
            "forward_sync_buffers": bool(forward), "init_sync_buffers": bool(init_buffers),
            "device_ids": list(device_ids) if device_ids is not None else None}


def engine_options(given: dict[str, Any]) -> dict[str, Any]:
    """The engine's comm.* options: from `comm=` (a CommConfig) or the keywords, never both."""
    options = {name: given[name] for name in ENGINE_OPTIONS}
    extra = dict(given["compressor_options"] or {})
    comm = given["comm"]
    if comm is not None:
        set_too = sorted(k for k, v in options.items() if v != getattr(_D, k))
        if set_too:
            raise TypeError(f"give engine options in comm= or as keywords, not both: {set_too}")
        options = {name: getattr(comm, name) for name in ENGINE_OPTIONS}
        extra = {**comm.compressor_options(), **extra}
    options["compressor"] = options["compressor"] or "none"
    options["compressor_options"] = extra
    return options


def data_parallel_group(given: dict[str, Any], group):
    """The group from `topology=` (a Topology, whose groups are made now, or its RankGroups) or `group`."""
    topology = given["topology"]
    if topology is None:
        return group
    if group is not None:
        raise TypeError("give group= (or process_group=) or topology=, not both")
    groups = topology.init_groups() if hasattr(topology, "init_groups") else topology
    return groups.dp_group
