"""Fully sharded data parallelism's costs (`Plan.shard` gradients / full / hybrid, paraloom's
`parallel.shard` on torch's fully_shard): each unit's all-gathers and reduce-scatters with prefetch
overlap, and what a rank holds — shards, the units gathered at once, their buffers.

A unit is one of the profile's layers (the GPT's blocks, embedding and head: its top-level pieces);
with tensor parallelism (`plan.tp`) each tp rank's slices are sharded over its data-parallel ranks,
a 1/tp share of every unit.
Per micro-batch every unit is all-gathered before its forward and, resharded after forward (`full`,
`hybrid`), again before its backward; after the last micro-batch's backward its gradients are
reduce-scattered (hybrid: inside a node, then all-reduced across the replicas in shards). With
pipeline stages (`plan.pp` > 1) each stage is sharded over its data-parallel ranks and priced as
one such model: its units are gathered at its first micro-batch and kept until the step's last
backward (no gather per micro-batch, the whole stage gathered meanwhile). A
unit's gather overlaps the previous unit's compute (prefetch), a reduce-scatter the backward of the
units before it: what shows is the first unit's gather, the last unit's reduction, and whatever
the collectives of a phase take beyond its compute.

Accumulation's micro-batches (`plan.shard_accumulate`): "unsharded" reduce-scatters on the last one
only (each unit's whole gradient kept meanwhile, as torch's `set_requires_gradient_sync(False)` keeps
it), "sharded" reduce-scatters every micro-batch into the shards (m reductions).

Memory (the mechanisms as torch's FSDP2 holds them; benchmarks/sharding.py measures them by kind,
operator by operator): fp32 shards of parameters and optimizer state, 1/s each on a group of s
ranks, all step; the peak is forward's or backward's, whichever holds more:
- forward: the computing unit's gathered parameters (compute dtype) with the all-gather outputs of
  it and of the `prefetch` units ahead; without resharding (`gradients`, `reshard_after_forward`
  off) every unit gathered so far stays, the whole model by forward's end. From accumulation's
  second micro-batch on, the gradients added up so far: the whole model's unsharded (fp32) or its
  shards.
- backward: one unit's unsharded gradient and the reduce-scatter input it is copied into (fp32),
  with the gradient shards reduced so far and the unit's gathered parameters; without resharding
  the whole model is gathered at backward's start (the gradients then not yet reduced), and with
  unsharded accumulation every unit's whole gradient stays until its last reduction.
"""

from __future__ import annotations

from collections.abc import Callable

from paraloom.perfmodel.cost.network import allgather_time, allreduce_time, reduce_scatter_time
from paraloom.perfmodel.model_profile import OPTIMIZER_STATES, ModelProfile

PREFETCH = 1  # parallel.shard_prefetch's default: units gathered ahead of the computing one


def shard_group(plan, devices_per_node: int) -> int:
    """The ranks one copy of the model is sharded over: every data-parallel rank, or for hybrid
    `plan.shard_group` (0: a node's data-parallel ranks, its devices over tp)."""
    if plan.shard != "hybrid":
        return plan.dp
    return min(plan.dp, plan.shard_group or max(1, devices_per_node // plan.tp))


def largest_unit(part: ModelProfile, units: tuple[int, ...] = ()) -> float:
    """The parameters of the largest unit: of `units` (each unit's, the root's last, as
    `Options.shard_units` gives them) where given, else the profile's largest layer. A pipeline
    stage (`part` a slice of the model `units` cut) holds no unit larger than its largest layer: its
    root has only the stage's ends."""
    layer = max(layer.param_count for layer in part.layers)
    if not units:
        return float(layer)
    return float(max(units) if part.n_params >= sum(units) else min(max(units), layer))


def unit_count(part: ModelProfile, units: tuple[int, ...] = ()) -> float:
    """How many units `part` is gathered and reduced in, its root one of them: of `units` (the whole
    model's, its root last), `part`'s share of the others plus its own root (a pipeline stage is
    sharded with a root of its own); else its layers, the two ends (the embedding and the head) one
    root."""
    if not units:
        return max(1, len(part.layers) - 1)
    return 1.0 + (len(units) - 1) * min(1.0, part.n_params / max(sum(units), 1))


def sharded_state(part: ModelProfile, plan, optimizer: str, group: int, *, prefetch: int = PREFETCH,
                  reshard: bool = True, units: tuple[int, ...] = ()) -> dict[str, float]:
    """Bytes of training state one rank holds at its peak (forward's or backward's), by kind
    (memory.stage_memory's kinds); `reshard`: `parallel.reshard_after_forward`; `units`: as
    `largest_unit` takes them."""
    params = part.n_params / plan.tp  # a tp rank's slices (replicated parameters counted as split)
    compute = part.dtype_bytes  # units gather in the run's precision; shards stay fp32
    unit = largest_unit(part, units) / plan.tp
    shards = params * 4.0 / group
    optimizer_bytes = params * 4.0 * OPTIMIZER_STATES[optimizer] / group
    # every unit stays gathered from forward to backward (a pipeline stage's: all step)
    kept = plan.shard == "gradients" or not reshard or plan.pp > 1
    accumulating = plan.microbatches > 1
    unsharded_sums = accumulating and plan.shard_accumulate == "unsharded"
    # forward: the units gathered, and what earlier micro-batches' gradients left
    gathered = params * compute + unit * compute if kept else unit * compute * (2 + prefetch)
    summed = (params * 4.0 if unsharded_sums else shards) if accumulating else 0.0
    forward = {"weights": shards + gathered, "grads": summed}
    # backward: a unit's gradient and its reduce-scatter input, the shards reduced (or, accumulating
    # unsharded, every unit's whole gradient), the gathered parameters (all of them at its start if kept)
    if unsharded_sums:
        backward = {"weights": shards + (params if kept else unit) * compute,
                    "grads": params * 4.0 + unit * 4.0}
    elif kept:  # at backward's start everything gathered, no shard reduced yet; at its end the reverse
        backward = {"weights": shards + max(params * compute, unit * compute + shards),
                    "grads": 2 * unit * 4.0}
    else:
        backward = {"weights": shards + unit * compute, "grads": shards + 2 * unit * 4.0}
    peak = max(forward, backward, key=lambda kinds: sum(kinds.values()))
    return {**peak, "optimizer": optimizer_bytes, "buffers": 0.0}


HOST_RATE = "shard_host.s_per_byte"  # a Hardware constant: the host's seconds per byte gathered or reduced


def sharded_sync(part: ModelProfile, plan, fwd: float, bwd: float, link, inter_link, group: int,
                 microbatches: int, *, reshard: bool = True, host_rate: float = 0.0,
                 gloo: bool = False, arrival: Callable[[float], float] | None = None,
                 units: tuple[int, ...] = ()) -> tuple[float, float]:
    """(exposed seconds, seconds on the links) of one step's gathers and reductions: `fwd` and `bwd`
    the step's forward and backward compute, `link` the sharding group's, `inter_link` the link
    hybrid's replicas all-reduce over, `reshard`: `parallel.reshard_after_forward`. `host_rate`: the
    machinery's own seconds per byte of a unit gathered or reduced (copying each unit's parameters out
    of the all-gather and its gradients into the reduce-scatter, the hooks, the DTensor steps), paid
    by the computing thread and so never hidden; measured by a one-rank fully sharded run against a
    plain one (`HOST_RATE` in a calibrated CPU profile; 0 where not measured).

    `gloo`: a CPU host's collectives (a profile `calibrate` measured here), and two mechanisms of
    theirs. They hold up the computing thread: torch's fully_shard overlaps its gathers and
    reduce-scatters with compute through CUDA streams, and without them gloo's collectives return
    when done (issuing the gathers asynchronously, torch's `_set_unshard_async_op`, moved a 2 x 1
    Gbit/s `full` step by 1-4% on this 2-core machine), so their whole time shows. And gloo's
    reduce-scatter is an all-reduce whose slice each rank keeps: across 2 and 4 emulated nodes at
    100 Mbit/s and 1 Gbit/s it took 1.00-1.05x the all-reduce of the same bytes, its all-gather
    0.50-0.63x (2026-12-07, benchmarks/LOG.md). Both were found after a measured run missed:
    the first from benchmarks/sharding.py's quick run (`full` dp2 at 1 Gbit/s, 35% slower than
    predicted with overlap), the second from its run 1 (every sharded configuration 16-36% slower
    than predicted); the configurations measured before are marked `seen` in its report.

    `arrival(segment_s)`: what one blocking collective costs beyond its own time when the ranks compute
    `segment_s` between collectives (cost/cpu.py `arrival_seconds`, measured on the host); under gloo
    every unit's gather, reduce-scatter and hybrid all-reduce blocks (`unit_count`). Added after
    benchmarks/sharding.py's run 2 (its 21 configurations 3-40% slower than predicted, all one way)
    and a micro-benchmark of the mechanism (benchmarks/collective_arrival.py); configurations
    measured after it are held out. `units`: as `largest_unit` takes them."""
    if group == 1 and plan.dp == 1 and not host_rate:
        return 0.0, 0.0
    params, compute = part.n_params / plan.tp, part.dtype_bytes  # a tp rank's slices
    unit = min(1.0, largest_unit(part, units) / max(part.n_params, 1))
    gather = allgather_time(params * compute, group, link) if group > 1 else 0.0
    reduction = allreduce_time if gloo else reduce_scatter_time  # gloo's: an all-reduce, a slice kept
    reduce = reduction(params * 4.0, group, link) if group > 1 else 0.0
    replicas = plan.dp // group
    if replicas > 1:
        reduce += allreduce_time(params * 4.0 / group, replicas, inter_link)
    regather = plan.shard != "gradients" and reshard and plan.pp == 1
    reductions = microbatches if plan.shard_accumulate == "sharded" else 1
    gathers = 1 if plan.pp > 1 else microbatches  # a pipeline stage's units: gathered once a step
    forward_comm = gather * gathers
    backward_comm = gather * gathers * regather + reduce * reductions
    first, last = gather * unit, reduce * unit  # nothing to overlap the first gather, the last reduction
    exposed = first + max(0.0, forward_comm - first - fwd) + last + max(0.0, backward_comm - last - bwd)
    if gloo:
        exposed = forward_comm + backward_comm
    handled = params * compute * gathers * (1 + regather) + params * 4.0 * reductions
    exposed += handled * host_rate
    if gloo and arrival is not None and group > 1:
        blocking = unit_count(part, units) * (gathers * (1 + regather) + reductions * (1 + (replicas > 1)))
        exposed += blocking * arrival((fwd + bwd) / blocking)
    return exposed, forward_comm + backward_comm
