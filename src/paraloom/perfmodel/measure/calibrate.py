"""`paraloom calibrate`: this machine's constants as a hardware profile, and their refinement from runs.

Micro-benchmarks, each timed as the median of repeats after a warm-up, on one worker's share of
the cores (`threads`): matmul, convolution and attention throughput, element-wise throughput and
memory bandwidth (a large copy), each op's dispatch (`cpu_host`), and the collectives' alpha and
beta (ring all-reduce over a range of sizes, fitted with the alpha-beta model) on loopback or across
an emulated cluster.
The links are timed by functions the caller hands in (`LinkTimers`). Refining these constants
from finished runs is `perfmodel.runs.refine`.
"""

from __future__ import annotations

import os
import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from paraloom.config.choices import WIRE_DTYPES
from paraloom.perfmodel.cost.cpu import (
    TCP_CPU_INTRA,
)
from paraloom.perfmodel.cost.network import fit_alpha_beta, fit_sustained_bandwidth, group_key
from paraloom.perfmodel.cost.storage import READ_BANDWIDTH, measure_read_rate
from paraloom.perfmodel.hardware import Device, Hardware, Link
from paraloom.perfmodel.measure import machine_profile
from paraloom.perfmodel.measure.cpu_host import measure_host
from paraloom.perfmodel.measure.microbench import codec_rates, compute_rates

LINK_SIZES = [2**k for k in range(14, 25, 2)]  # 16 KB .. 16 MB
GROUP_ALGORITHM = "native"


@dataclass(frozen=True)
class LinkTimers:
    """How calibration times links, handed in by its caller (`paraloom.cli.link_timers` builds it from
    the collectives benchmark and the emulated cluster's link test), so the model does not reach up
    to either."""

    # all-reduce sweeps: keyword arguments sizes, algorithms, cluster, nproc, min_repeats, max_repeats,
    # budget_s, progress, dtype -> a report with "results" rows and "config" (`bench.collectives`)
    collectives: Callable[..., dict[str, Any]]
    # MB/s of one TCP stream between nodes of `cluster` (loopback when None) moving `nbytes`
    stream_mb_s: Callable[[Any, int], list[float]]
    # an emulated link's token bucket in bytes at a rate in bits/s (`cluster.emulated.burst_bytes`)
    burst_bytes: Callable[[int], int]


def measure_compute(threads: int = 1, min_s: float = 0.05) -> dict[str, float]:
    """FLOP/s by op class and memory bandwidth (bytes/s) of the CPU on `threads` threads, fp32."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return compute_rates(torch.device("cpu"), "fp32", min_s=min_s)
    finally:
        torch.set_num_threads(previous)


def measure_codecs(threads: int = 1, elements: int = 1 << 22) -> dict[str, float]:
    """Seconds per fp32 gradient byte to compress and decompress, per compressor (a 16 MB tensor)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {name: 1.0 / bytes_per_s
                for name, bytes_per_s in codec_rates(torch.device("cpu"), elements * 4).items()}
    finally:
        torch.set_num_threads(previous)


def measure_p2p(timers: LinkTimers, cluster=None) -> float:
    """Bytes/s of one TCP stream between two nodes (or over loopback): point-to-point traffic."""
    return max(timers.stream_mb_s(cluster, 64 << 20)) * 1e6


def measure_link(timers: LinkTimers, cluster=None, nproc: int = 2, dtype: str = "float32",
                 algorithm: str = "ring", floor: bool = False) -> tuple[float, float, list[dict[str, Any]]]:
    """(alpha seconds, bandwidth bytes/s, rows) of the `algorithm` all-reduce of `dtype` on loopback or
    `cluster`: alpha from the whole sweep, the bandwidth from the sizes of 1 MiB and up
    (`fit_sustained_bandwidth`).

    With `floor`, alpha is fitted to each size's fastest repeat instead of its median: the link's
    own start-up cost. Each repeat starts at a barrier, and the ranks leave it apart; on two
    processes the median of a 16 KiB all-reduce at 1 Gbit/s came out 0.5 to 3.4 ms between sweeps
    (its fastest repeat 0.23 to 0.40 ms), and single fits of alpha from 0 to 1.5 ms."""
    sustained = sustained_bytes(timers, cluster)
    sizes = LINK_SIZES + [s for s in (2**26,) if sustained > LINK_SIZES[-1] // 4]
    report = timers.collectives(sizes=sizes, algorithms=[algorithm], cluster=cluster, nproc=nproc,
                             min_repeats=3, max_repeats=10, budget_s=1.0, progress=False, dtype=dtype)
    rows = report["results"]
    n = report["config"]["world_size"]
    sizes, seconds = [r["bytes"] for r in rows], [r["seconds"] for r in rows]
    alpha, _ = fit_alpha_beta(sizes, [r["seconds_min"] for r in rows] if floor else seconds, n, algorithm)
    return alpha, fit_sustained_bandwidth(sizes, seconds, n, alpha, algorithm, min_bytes=sustained), rows


def sustained_bytes(timers: LinkTimers, cluster=None) -> int:
    """The smallest all-reduce whose time the sustained bandwidth is fitted on: 1 MiB, or on an
    emulated cluster 16x its links' token bucket, where the burst is worth at most ~6% (at
    10 Gbit/s the 2.5 MB bucket let a 16 MB transfer through at an apparent 1.6 GB/s, above the
    line rate; at 1 Gbit/s the 250 KB one a 1 MiB transfer at 132 MB/s). Sizes past 4 MiB make
    the sweep go to 64 MiB."""
    if cluster is None:
        return 1 << 20
    return max(1 << 20, 16 * timers.burst_bytes(cluster.spec.rate_bits))


def tcp_cpu_from_rows(rows: list[dict[str, Any]]) -> float:
    """A process's CPU seconds per byte it sends or receives, from a 2-process all-reduce's rows
    (sizes of 1 MiB and up, median): each process sends and receives the whole tensor once, and
    its sums are a small part of the work."""
    return statistics.median(r["cpu_seconds"] / r["bytes"] for r in rows if r["bytes"] >= 1 << 20) / 2


def measure_groups(timers: LinkTimers, clusters) -> dict[str, float]:
    """gloo's own all-reduce (`comm.algorithm=native`, the engine's default) across each emulated
    cluster (n = its node count) for each wire dtype, as `group_key` constants: n processes sharing
    one host's cores move bytes slower than the two the inter link is fitted on, and gloo sums bf16
    with more CPU per byte than fp32 (fp16 payloads of 1 MiB and more go around paraloom's ring, as
    the engine's do: `comm.algorithms`).
    Also each process's CPU seconds per byte all-reduced (sizes of 1 MiB and up, median): the
    kernel's TCP and the sums run on the cores the training computes on.

    A group has one latency, the median of its three dtypes' fits: a message's start-up cost does
    not depend on what it holds, and one sweep's fit is noisy (at 2 nodes and 10 Gbit/s single fits
    ranged from 0.14 to 1.34 ms in one calibration); each dtype's bandwidth is refitted with it."""
    out: dict[str, float] = {}
    for cluster in clusters:
        sweeps = {dtype: measure_link(timers, cluster, dtype=dtype, algorithm=GROUP_ALGORITHM)
                  for dtype in WIRE_DTYPES}
        alpha = statistics.median(fit[0] for fit in sweeps.values())
        sustained = sustained_bytes(timers, cluster)
        for dtype, (_, _, rows) in sweeps.items():
            sizes, seconds = [r["bytes"] for r in rows], [r["seconds"] for r in rows]
            out[group_key(cluster.nodes, dtype, GROUP_ALGORITHM, "bandwidth")] = fit_sustained_bandwidth(
                sizes, seconds, cluster.nodes, alpha, GROUP_ALGORITHM, min_bytes=sustained)
            out[group_key(cluster.nodes, dtype, GROUP_ALGORITHM, "latency")] = alpha
            cpu = [r["cpu_seconds"] / r["bytes"] for r in rows if r["bytes"] >= 1 << 20]
            out[group_key(cluster.nodes, dtype, GROUP_ALGORITHM, "cpu_s_per_byte")] = statistics.median(cpu)
    return out


def build_profile(compute: dict[str, float], intra: Link, inter: Link, *, name: str,
                  devices_per_node: int, host_cores: int | None) -> Hardware:
    """A hardware profile: peak = measured matmul rate, efficiency = each class against it."""
    peak = compute["matmul"]
    efficiency = {c: min(1.0, compute[c] / peak) for c in ("matmul", "conv", "attention", "other")}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, devices_per_node)
    device = Device(name="cpu", peak_flops={"fp32": peak}, efficiency=efficiency,
                    mem_bandwidth=compute["bandwidth"], mem_capacity=memory)
    constants = {"host_cores": float(host_cores)} if host_cores else {}
    return Hardware(name=name, device=device, devices_per_node=devices_per_node, intra=intra, inter=inter,
                    constants=constants)


def calibrate(*, timers: LinkTimers, cluster=None, devices_per_node: int = 1, threads: int = 1,
              name: str = "this-machine", group_clusters=(), progress: Callable[[str], None] = lambda _: None,
              storage: Path | None = None) -> tuple[Hardware, dict[str, Any]]:
    """Measure this machine; inter-node constants come from `cluster` (emulated) when given.

    The ring all-reduce's alpha and beta describe collectives (its beta includes the reduction's
    CPU work); a single TCP stream's throughput (`p2p_bandwidth.*`) describes point-to-point
    traffic (parameter-server push and pull, pipeline activations), which moves more per second.
    With `cluster`, the all-reduce is also measured per wire dtype at its size and across each of
    `group_clusters` (emulated clusters of other sizes at the same rate): `measure_groups`.

    The links (loopback, inter-node) describe the wire, so their alpha is the floor
    (`measure_link(floor=True)`); a group's constants describe what n processes sharing this
    host's cores achieve, waits included, so theirs come from the median repeats.
    With `storage`, the read rate of a fresh file there too (`storage.measure_read_rate`).
    """
    progress("compute: matmul, conv, attention, element-wise, memory bandwidth")
    compute = measure_compute(threads)
    progress("dispatch: each op's cost beyond its arithmetic")
    host = measure_host(threads)
    progress("compressors: encode and decode")
    codecs = measure_codecs(threads)
    progress("links: ring all-reduce and one TCP stream on loopback")
    alpha, bandwidth, loop_rows = measure_link(timers, None, nproc=2, floor=True)
    intra = Link("loopback", bandwidth, alpha)
    links = {"p2p_bandwidth.intra": measure_p2p(timers, None), TCP_CPU_INTRA: tcp_cpu_from_rows(loop_rows)}
    inter, inter_rows = intra, []
    if cluster is not None:
        progress(f"links: ring all-reduce and one TCP stream across {cluster.nodes} emulated nodes")
        alpha, bandwidth, inter_rows = measure_link(timers, cluster, floor=True)
        inter = Link(f"emulated {cluster.spec.rate}", bandwidth, alpha)
        links["p2p_bandwidth.inter"] = measure_p2p(timers, cluster)
        sizes = ", ".join(str(c.nodes) for c in (cluster, *group_clusters))
        progress(f"links: gloo's all-reduce per wire dtype among {sizes} emulated nodes")
        links.update(measure_groups(timers, (cluster, *group_clusters)))
    else:
        links["p2p_bandwidth.inter"] = links["p2p_bandwidth.intra"]
    # every emulated node is a process on this host: they share its cores (strategies.host_slowdown)
    hw = build_profile(compute, intra, inter, name=name, devices_per_node=devices_per_node,
                       host_cores=(os.cpu_count() or 1) // max(1, threads))
    extra = {**links, **host, **{f"codec_s_per_byte.{k}": v for k, v in codecs.items()}}
    if storage is not None:
        progress(f"storage: the read rate of a fresh file in {storage}")
        extra[READ_BANDWIDTH], _ = measure_read_rate(storage)
    hw = replace(hw, constants={**hw.constants, **extra})
    return hw, {"compute": compute, "codecs": codecs, "loopback_rows": loop_rows, "inter_rows": inter_rows}


def calibrate_once(threads: int, progress: Callable[[str], None], timers: LinkTimers,
                   cluster=None) -> Path | None:
    """This machine's cached profile, measured now if there is none yet: on loopback, or with
    `cluster` (an emulated one) its inter-node link across that cluster, cached per link rate;
    None where `$PARALOOM_HARDWARE` names the profile instead."""
    link = cluster.spec.rate if cluster is not None else None
    path = machine_profile.cached_path(threads, link=link)
    if os.environ.get("PARALOOM_HARDWARE"):
        return None
    if path.is_file():
        return path
    where = f", with its links across an emulated {link} cluster (a minute)" if link else " (about 20 s)"
    progress(f"calibrating this machine once{where}, cached in {path}")
    links = f"emulated {link}" if link else "loopback"
    hw, _ = calibrate(timers=timers, cluster=cluster, threads=threads,
                      name=f"{socket.gethostname()} ({links}, {threads} threads)",
                      progress=lambda what: progress(f"  measuring {what}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(hw.to_yaml())
    os.replace(staging, path)  # whole or absent, when two runs calibrate at once
    return path
