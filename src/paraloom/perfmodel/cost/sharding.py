"""Fully sharded data parallelism's costs (`Plan.shard` gradients / full / hybrid, paraloom's
`parallel.shard` on torch's fully_shard): each unit's all-gathers and reduce-scatters with prefetch
overlap, and what a rank holds — shards, the units gathered at once, their buffers.

A unit is one of the profile's layers (the GPT's blocks, embedding and head: its top-level pieces).
Per micro-batch every unit is all-gathered before its forward and, resharded after forward (`full`,
`hybrid`), again before its backward; after the last micro-batch's backward its gradients are
reduce-scattered (hybrid: inside a node, then all-reduced across the replicas in shards). A
unit's gather overlaps the previous unit's compute (prefetch), a reduce-scatter the backward of the
units before it: what shows is the first unit's gather, the last unit's reduction, and whatever
the collectives of a phase take beyond its compute.

Memory (the mechanisms as torch's FSDP2 holds them; benchmarks/sharding.py measures them by kind):
fp32 shards of parameters, gradients and optimizer state, 1/s each on a group of s ranks; in flight,
the computing unit's gathered parameters in the compute dtype and the all-gather outputs of it and
of the `prefetch` units ahead (`gradients`: every unit stays gathered from its forward to its
backward); in backward, one unit's unsharded gradients and their reduce-scatter input in fp32.
"""

from __future__ import annotations

from paraloom.perfmodel.cost.network import allgather_time, allreduce_time, reduce_scatter_time
from paraloom.perfmodel.model_profile import OPTIMIZER_STATES, ModelProfile

PREFETCH = 1  # parallel.shard_prefetch's default: units gathered ahead of the computing one


def shard_group(plan, devices_per_node: int) -> int:
    """The ranks one copy of the model is sharded over: every data-parallel rank, or for hybrid
    `plan.shard_group` (0: a node's devices)."""
    if plan.shard != "hybrid":
        return plan.dp
    return min(plan.dp, plan.shard_group or devices_per_node)


def sharded_state(part: ModelProfile, plan, optimizer: str, group: int) -> dict[str, float]:
    """Bytes of training state one rank holds at its peak, by kind (memory.stage_memory's kinds)."""
    params = part.n_params
    compute = part.dtype_bytes  # units gather in the run's precision; shards stay fp32
    unit = max(layer.param_count for layer in part.layers)
    if plan.shard == "gradients":  # every unit gathered from forward to backward, and one buffer
        gathered = params * compute + unit * compute
    else:  # the computing unit, and the all-gather outputs of it and of the prefetched ones
        gathered = unit * compute * (2 + PREFETCH)
    return {"weights": params * 4.0 / group + gathered,
            "grads": params * 4.0 / group + 2 * unit * 4.0,  # a unit's unsharded gradient and its input
            "optimizer": params * 4.0 * OPTIMIZER_STATES[optimizer] / group,
            "buffers": 0.0}


def sharded_sync(part: ModelProfile, plan, fwd: float, bwd: float, link, inter_link, group: int,
                 microbatches: int) -> tuple[float, float]:
    """(exposed seconds, seconds on the links) of one step's gathers and reductions: `fwd` and `bwd`
    the step's forward and backward compute, `link` the sharding group's, `inter_link` the link
    hybrid's replicas all-reduce over."""
    if group == 1 and plan.dp == 1:
        return 0.0, 0.0
    params, compute = part.n_params, part.dtype_bytes
    unit = max(layer.param_count for layer in part.layers) / max(params, 1)
    gather = allgather_time(params * compute, group, link) if group > 1 else 0.0
    reduce = reduce_scatter_time(params * 4.0, group, link) if group > 1 else 0.0
    replicas = plan.dp // group
    if replicas > 1:
        reduce += allreduce_time(params * 4.0 / group, replicas, inter_link)
    regather = plan.shard != "gradients"
    forward_comm = gather * microbatches
    backward_comm = gather * microbatches * regather + reduce
    first, last = gather * unit, reduce * unit  # nothing to overlap the first gather, the last reduction
    exposed = first + max(0.0, forward_comm - first - fwd) + last + max(0.0, backward_comm - last - bwd)
    return exposed, forward_comm + backward_comm
