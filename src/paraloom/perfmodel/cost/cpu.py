"""What communication costs the CPU: per byte a process sends or receives, the share overlap cannot
hide, and a parameter server's work per step (bytes and messages); constants from `paraloom calibrate`,
the server's fitted from its runs (`server_cpu_per_message`).

On an emulated cluster every node is a process of one host, so the kernel's TCP and gloo's sums run
on the cores the training computes on; on presets and real clusters the constants are absent and
these terms are 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from paraloom.perfmodel.cost.network import group_key, group_link
from paraloom.perfmodel.hardware import Hardware

if TYPE_CHECKING:
    from paraloom.perfmodel.plan import Options, Plan

TCP_CPU_INTRA = "tcp_cpu_s_per_byte.intra"  # a process's CPU per byte over loopback (paraloom calibrate)
SERVER_PER_MESSAGE = "ps.server_s_per_message"  # a parameter server's CPU per request, bytes aside
SERVER_PER_UPDATE = "ps.server_s_per_update"  # its CPU per optimizer step of one slice
WIRE_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}  # what a compressor all-reduces; the rest: fp32 bytes


def ps_slices(grad_bytes: float, plan: Plan, opts: Options) -> int:
    """Messages per server shard and step (parameter_server/shard.slice_layout, fp32 parameters)."""
    return max(1, math.ceil(grad_bytes / plan.servers / (opts.ps_partition_mb * 2**20)))


def unhidden_cpu(exposed: float, total: float, cpu: float) -> float:
    """Exposed communication seconds once its CPU work is counted: the part that overlaps
    backward hides its waiting on the wire, not the share `cpu / total` it keeps the CPU busy."""
    if cpu <= 0 or total <= 0:
        return exposed
    return exposed + max(0.0, total - exposed) * min(1.0, cpu / total)


def tcp_cpu_per_byte(hw: Hardware, inter: bool = True) -> float:
    """A process's CPU seconds per byte it sends or receives point to point: across nodes half the
    2-worker fp32 all-reduce's per byte of tensor (each of the two sends and receives the whole
    tensor once; its sums are a small part), on one node `tcp_cpu_s_per_byte.intra` (loopback's,
    the same way); 0 where not measured."""
    if inter:
        return hw.constants.get(group_key(2, "float32", "native", "cpu_s_per_byte"), 0.0) / 2
    return hw.constants.get(TCP_CPU_INTRA, 0.0)


def crosses_nodes(hw: Hardware, plan: Plan) -> bool:
    """Whether the data-parallel group spans nodes (its traffic takes the inter-node link)."""
    return group_link(plan.dp, hw.devices_per_node, hw.intra, hw.inter, stride=plan.tp) is hw.inter


def server_cpu(hw: Hardware, plan: Plan, opts: Options, push_bytes: float, grad_bytes: float) -> float:
    """One parameter server's CPU seconds per step: every worker's push and pull of its shard at the
    link's TCP cost, plus per request (a slice's push or read, and its reply) the decoding, summing,
    copying and thread wake-ups the bytes do not explain (`ps.server_s_per_message`), plus per
    optimizer step of a slice (`ps.server_s_per_update`): BSP steps each slice once a clock, ASP
    and SSP once a push. Both fitted by `paraloom calibrate --from` on a parameter-server run (a
    run from before the server timed its steps fits the first alone, the updates inside); 0 where
    not fitted."""
    moved = plan.dp * (push_bytes + grad_bytes) / plan.servers
    slices = ps_slices(grad_bytes, plan, opts)
    updates = slices if plan.consistency == "bsp" else plan.dp * slices
    per_message = hw.constants.get(SERVER_PER_MESSAGE, 0.0)
    per_update = hw.constants.get(SERVER_PER_UPDATE, 0.0)
    return (moved * tcp_cpu_per_byte(hw, crosses_nodes(hw, plan)) + plan.dp * slices * per_message
            + updates * per_update)


def comm_cpu(hw: Hardware, plan: Plan, grad_bytes: float) -> float:
    """A worker's CPU seconds in one step's all-reduce (`allreduce.n<dp>.<dtype>.<algorithm>.
    cpu_s_per_byte`, measured by `paraloom calibrate` on an emulated cluster, where the kernel's
    TCP and gloo's sums run on the cores the workers compute on); 0 where not measured."""
    if plan.compressor not in ("none", *WIRE_DTYPE):
        return 0.0
    dtype = WIRE_DTYPE.get(plan.compressor, "float32")
    per_byte = hw.constants.get(group_key(plan.dp, dtype, plan.algorithm, "cpu_s_per_byte"), 0.0)
    return per_byte * grad_bytes * (0.5 if dtype != "float32" else 1.0)


def server_cpu_per_message(summary: dict[str, Any], hw: Hardware) -> dict[str, float]:
    """A parameter-server run's servers' CPU seconds per request (a push or a read of one slice,
    answered by one reply), once the TCP cost of the bytes they moved and the optimizer steps
    they took are taken out, and per optimizer step of a slice.

    A server's CPU also decodes, sums and copies its shard, and wakes a thread per message; those
    costs scale with messages, not with the link. Its optimizer steps scale with updates: one a
    slice and clock under BSP however many workers push, one a push under ASP and SSP; the server
    times them on its own thread (`update_cpu_seconds`; a summary from before has no such figure,
    and its per-message cost then holds the updates). Bytes moved per step: every worker's push
    and pull (`comm_bytes_per_step`), spread over the servers; TCP CPU per byte: loopback's for a
    run on one node, else half the 2-node all-reduce's (`strategies`).
    """
    steps, workers = summary["steps"], summary["workers"]
    stats = summary["servers_stats"]
    cpu = sum(s["cpu_seconds"] for s in stats)
    messages = sum(s["slices"] for s in stats) * workers * steps
    moved = summary["comm_bytes_per_step"] * workers * steps
    per_byte = tcp_cpu_per_byte(hw, inter=summary.get("nodes", 1) > 1)
    fitted = {"server_cpu_s_per_step": cpu / steps / len(stats)}
    if all("update_cpu_seconds" in s for s in stats) and sum(s["updates"] for s in stats):
        updating = sum(s["update_cpu_seconds"] for s in stats)
        fitted["server_s_per_update"] = updating / sum(s["updates"] for s in stats)
        cpu -= updating
    return {**fitted, "server_s_per_message": (cpu - moved * per_byte) / messages}


# constants "collective_arrival.n{ranks}.ms{segment}": the seconds a blocking collective waits beyond its own
ARRIVAL = "collective_arrival"


def arrival_key(ranks: int, segment_ms: float) -> str:
    return f"{ARRIVAL}.n{ranks}.ms{segment_ms:g}"


def arrival_seconds(hw: Hardware, ranks: int, segment_s: float) -> float:
    """What one blocking collective costs beyond its own time on a host whose `ranks` workers compute
    segments of `segment_s` (as they run together) between such collectives: the ranks arriving apart
    (a rank whose segment ran longer holds the others). Measured on the host for a few rank counts
    and segment lengths (benchmarks/collective_arrival.py: constants `arrival_key(n, ms)`, the
    segment as one idle core runs it), read at the nearest measured rank count, interpolated in
    the logarithm of the segment (linearly to 0 below the shortest, flat above the longest); 0
    where not measured (presets, real clusters)."""
    measured: dict[int, list[tuple[float, float]]] = {}
    for key, value in hw.constants.items():
        if key.startswith(f"{ARRIVAL}.n"):
            n, ms = key.removeprefix(f"{ARRIVAL}.n").split(".ms")
            measured.setdefault(int(n), []).append((float(ms) / 1e3, value))
    if not measured or segment_s <= 0:
        return 0.0
    n = min(measured, key=lambda m: (abs(m - ranks), -m))
    points = sorted(measured[n])
    cores = hw.constants.get("host_cores") or n
    segment = segment_s / max(1.0, n / cores)  # as one idle core would run it
    if segment <= points[0][0]:
        return points[0][1] * segment / points[0][0]
    if segment >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= segment <= x1:
            return y0 + (math.log(segment) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (y1 - y0)
    return points[-1][1]
