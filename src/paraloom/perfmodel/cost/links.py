"""Which link a plan's messages take: a data-parallel group's, with a node's adapters shared among the
groups it holds and the flows each group's algorithm sends; point-to-point at the calibrated stream rate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paraloom.perfmodel.cost.cpu import WIRE_DTYPE
from paraloom.perfmodel.cost.network import group_key, group_link, hierarchical_wire
from paraloom.perfmodel.hardware import Hardware, Link

if TYPE_CHECKING:
    from paraloom.perfmodel.plan import Plan


def stream(hw: Hardware, link: Link) -> Link:
    """hw.intra or hw.inter at its calibrated single-stream rate (`p2p_bandwidth.*`), for
    point-to-point traffic; the link as it is when there is no such constant."""
    key = "p2p_bandwidth.inter" if link is hw.inter else "p2p_bandwidth.intra"
    bandwidth = hw.constants.get(key)
    return Link(link.name, bandwidth, link.latency) if bandwidth else link


def _measured_group(hw: Hardware, link: Link, plan: Plan) -> Link:
    """The inter-node link as the plan's all-reduce among its dp workers measured it for the
    compressor's wire dtype (`calibrate.measure_groups`:
    `allreduce.n<dp>.<dtype>.<algorithm>.bandwidth|latency`), where it was measured.

    On an emulated cluster every worker is a process of one host: n of them move bytes slower than the
    two the inter link was fitted on, and gloo sums fp16 and bf16 payloads with more CPU per byte
    than fp32. Without the constants (presets, real clusters) the link is used as it is.
    """
    dtype = WIRE_DTYPE.get(plan.compressor, "float32")
    bandwidth = hw.constants.get(group_key(plan.dp, dtype, plan.algorithm, "bandwidth"))
    latency = hw.constants.get(group_key(plan.dp, dtype, plan.algorithm, "latency"))
    if bandwidth is None or latency is None:
        return link
    return Link(link.name, bandwidth, latency)


def dp_per_node(hw: Hardware, plan: Plan) -> int:
    """A data-parallel group's ranks on one node: its ranks are tp apart, nodes hold devices_per_node."""
    return max(1, min(plan.dp, hw.devices_per_node // plan.tp))


def dp_group(hw: Hardware, plan: Plan) -> tuple[int, Link, float] | None:
    """(the group's ranks on a node, the inter-node link as the group's all-reduce measured it, the
    node's adapters over the data-parallel groups it holds), or None for a group inside one node."""
    link = group_link(plan.dp, hw.devices_per_node, hw.intra, hw.inter, stride=plan.tp)
    if link is not hw.inter:
        return None
    per_node = dp_per_node(hw, plan)
    nics = hw.nics_per_node / min(hw.devices_per_node, plan.tp * plan.pp)
    return per_node, _measured_group(hw, link, plan), nics


def dp_link(hw: Hardware, plan: Plan, *, p2p: bool = False) -> Link:
    """The data-parallel group's link (at the stream rate with `p2p`, else as the group's all-reduce
    measured it); groups that cross nodes share each node's adapters, as many flows of a group at
    once as its algorithm sends (network.hierarchical_wire)."""
    group = dp_group(hw, plan)
    if group is None:
        link = group_link(plan.dp, hw.devices_per_node, hw.intra, hw.inter, stride=plan.tp)
        return stream(hw, link) if p2p else link
    per_node, measured, nics = group
    if p2p:  # parameter-server messages: one flow a worker
        link = stream(hw, hw.inter)
        return Link(link.name, link.bandwidth * min(1.0, nics), link.latency)
    wire = hierarchical_wire(per_node, hw.intra, measured, plan.algorithm.removeprefix("hierarchical_"), nics)
    return Link(measured.name, wire.bandwidth, wire.latency)
