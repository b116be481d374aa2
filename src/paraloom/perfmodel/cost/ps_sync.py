"""What one BSP parameter-server step leaves exposed after backward: pushes during backward, pulls
hidden with them (paraloom's slice by slice) or after every push (TensorFlow's distributed_replicated)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from paraloom.perfmodel.cost.compression import compressed_bytes
from paraloom.perfmodel.cost.cpu import crosses_nodes, ps_slices, server_cpu, tcp_cpu_per_byte, unhidden_cpu
from paraloom.perfmodel.cost.links import dp_link, dp_per_node
from paraloom.perfmodel.cost.network import allreduce_time, ps_pull_time, ps_time
from paraloom.perfmodel.hardware import Hardware

if TYPE_CHECKING:
    from paraloom.perfmodel.plan import Options, Plan


def ps_pushers(hw: Hardware, plan: Plan, grad_bytes: float) -> tuple[int, float]:
    """(workers that push to the servers, seconds of summing inside a node first): every worker, or
    with `ps_node_sum` one push a node after a ring all-reduce of its workers' gradients."""
    if not plan.ps_node_sum:
        return plan.dp, 0.0
    per_node = dp_per_node(hw, plan)
    local = allreduce_time(grad_bytes, per_node, hw.intra, "ring") if per_node > 1 else 0.0
    return -(-plan.dp // per_node), local


def ps_bsp_sync(hw: Hardware, plan: Plan, opts: Options, grad_bytes: float,
                backward: float) -> tuple[float, float]:
    """(exposed seconds, seconds of the whole exchange) of one BSP step whose backward takes
    `backward` seconds. Pushes leave during backward and, in paraloom's client, each slice's reply
    with them; under `ps_node_sum` (TensorFlow's distributed_replicated) a GPU copies the variables
    back only once the servers have applied every push, so the pull phase is never hidden."""
    push = compressed_bytes(grad_bytes, plan.compressor)
    pushers, local = ps_pushers(hw, plan, grad_bytes)
    link, slices = dp_link(hw, plan, p2p=True), ps_slices(grad_bytes, plan, opts)
    total = ps_time(grad_bytes, pushers, plan.servers, link, push_bytes=push, slices=slices,
                    colocated=plan.ps_colocated)
    # a server's CPU is a bound too
    total = local + max(total, server_cpu(hw, replace(plan, dp=pushers), opts, push, grad_bytes))
    after = (ps_pull_time(grad_bytes, pushers, plan.servers, link, slices, plan.ps_colocated)
             if plan.ps_node_sum else 0.0)
    exposed = max(0.0, total - after - backward) + after
    own = (push + grad_bytes) * tcp_cpu_per_byte(hw, crosses_nodes(hw, plan))  # a worker's own CPU
    return unhidden_cpu(exposed, total, own), total
