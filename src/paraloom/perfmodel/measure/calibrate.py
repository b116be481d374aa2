"""`paraloom calibrate`: this machine's constants as a hardware profile, and their refinement from runs.

Micro-benchmarks, each timed as the median of repeats after a warm-up, on one worker's share of
the cores (`threads`): matmul, convolution and attention throughput, element-wise throughput and
memory bandwidth (a large copy), each op's dispatch (`cpu_host`), and the collectives' alpha and
beta (ring all-reduce over a range of sizes, fitted with the alpha-beta model) on loopback or across
an emulated cluster.
`refine` then fits the compute efficiency and a per-step overhead to measured runs (grey box:
the white-box formulas, constants from measurement).
"""

from __future__ import annotations

import os
import socket
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from paraloom.choices import WIRE_DTYPES
from paraloom.errors import UserError
from paraloom.perfmodel.cost.cpu import (
    SERVER_PER_MESSAGE,
    SERVER_PER_UPDATE,
    TCP_CPU_INTRA,
    server_cpu_per_message,
)
from paraloom.perfmodel.cost.device import without_dispatch
from paraloom.perfmodel.cost.network import fit_alpha_beta, fit_sustained_bandwidth, group_key
from paraloom.perfmodel.cost.step_time import host_slowdown
from paraloom.perfmodel.cost.storage import READ_BANDWIDTH, measure_read_rate
from paraloom.perfmodel.hardware import Device, Hardware, Link
from paraloom.perfmodel.measure import machine_profile
from paraloom.perfmodel.measure.cpu_host import measure_host
from paraloom.perfmodel.measure.microbench import codec_rates, compute_rates
from paraloom.perfmodel.plan import PIECE_OVERHEAD, PRIORITY_OVERHEAD, SYNC_OVERHEAD
from paraloom.perfmodel.runs.finished import finished, measured_and_predicted

LINK_SIZES = [2**k for k in range(14, 25, 2)]  # 16 KB .. 16 MB
GROUP_ALGORITHM = "native"


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


def measure_p2p(cluster=None) -> float:
    """Bytes/s of one TCP stream between two nodes (or over loopback): point-to-point traffic."""
    from paraloom.cluster.launch import link_throughput

    return max(link_throughput(cluster, 64 << 20)) * 1e6


def measure_link(cluster=None, nproc: int = 2, dtype: str = "float32", algorithm: str = "ring",
                 floor: bool = False) -> tuple[float, float, list[dict[str, Any]]]:
    """(alpha seconds, bandwidth bytes/s, rows) of the `algorithm` all-reduce of `dtype` on loopback or
    `cluster`: alpha from the whole sweep, the bandwidth from the sizes of 1 MiB and up
    (`fit_sustained_bandwidth`).

    With `floor`, alpha is fitted to each size's fastest repeat instead of its median: the link's
    own start-up cost. Each repeat starts at a barrier, and the ranks leave it apart; on two
    processes the median of a 16 KiB all-reduce at 1 Gbit/s came out 0.5 to 3.4 ms between sweeps
    (its fastest repeat 0.23 to 0.40 ms), and single fits of alpha from 0 to 1.5 ms."""
    from paraloom.bench.collectives import run_collectives

    sustained = sustained_bytes(cluster)
    sizes = LINK_SIZES + [s for s in (2**26,) if sustained > LINK_SIZES[-1] // 4]
    report = run_collectives(sizes=sizes, algorithms=[algorithm], cluster=cluster, nproc=nproc,
                             min_repeats=3, max_repeats=10, budget_s=1.0, progress=False, dtype=dtype)
    rows = report["results"]
    n = report["config"]["world_size"]
    sizes, seconds = [r["bytes"] for r in rows], [r["seconds"] for r in rows]
    alpha, _ = fit_alpha_beta(sizes, [r["seconds_min"] for r in rows] if floor else seconds, n, algorithm)
    return alpha, fit_sustained_bandwidth(sizes, seconds, n, alpha, algorithm, min_bytes=sustained), rows


def sustained_bytes(cluster=None) -> int:
    """The smallest all-reduce whose time the sustained bandwidth is fitted on: 1 MiB, or on an
    emulated cluster 16x its links' token bucket, where the burst is worth at most ~6% (at
    10 Gbit/s the 2.5 MB bucket let a 16 MB transfer through at an apparent 1.6 GB/s, above the
    line rate; at 1 Gbit/s the 250 KB one a 1 MiB transfer at 132 MB/s). Sizes past 4 MiB make
    the sweep go to 64 MiB."""
    if cluster is None:
        return 1 << 20
    from paraloom.cluster.emulated import burst_bytes

    return max(1 << 20, 16 * burst_bytes(cluster.spec.rate_bits))


def tcp_cpu_from_rows(rows: list[dict[str, Any]]) -> float:
    """A process's CPU seconds per byte it sends or receives, from a 2-process all-reduce's rows
    (sizes of 1 MiB and up, median): each process sends and receives the whole tensor once, and
    its sums are a small part of the work."""
    return statistics.median(r["cpu_seconds"] / r["bytes"] for r in rows if r["bytes"] >= 1 << 20) / 2


def measure_groups(clusters) -> dict[str, float]:
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
        sweeps = {dtype: measure_link(cluster, dtype=dtype, algorithm=GROUP_ALGORITHM)
                  for dtype in WIRE_DTYPES}
        alpha = statistics.median(fit[0] for fit in sweeps.values())
        for dtype, (_, _, rows) in sweeps.items():
            sizes, seconds = [r["bytes"] for r in rows], [r["seconds"] for r in rows]
            out[group_key(cluster.nodes, dtype, GROUP_ALGORITHM, "bandwidth")] = fit_sustained_bandwidth(
                sizes, seconds, cluster.nodes, alpha, GROUP_ALGORITHM, min_bytes=sustained_bytes(cluster))
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


def calibrate(*, cluster=None, devices_per_node: int = 1, threads: int = 1, name: str = "this-machine",
              group_clusters=(), progress: Callable[[str], None] = lambda _: None,
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
    alpha, bandwidth, loop_rows = measure_link(None, nproc=2, floor=True)
    intra = Link("loopback", bandwidth, alpha)
    links = {"p2p_bandwidth.intra": measure_p2p(None), TCP_CPU_INTRA: tcp_cpu_from_rows(loop_rows)}
    inter, inter_rows = intra, []
    if cluster is not None:
        progress(f"links: ring all-reduce and one TCP stream across {cluster.nodes} emulated nodes")
        alpha, bandwidth, inter_rows = measure_link(cluster, floor=True)
        inter = Link(f"emulated {cluster.spec.rate}", bandwidth, alpha)
        links["p2p_bandwidth.inter"] = measure_p2p(cluster)
        sizes = ", ".join(str(c.nodes) for c in (cluster, *group_clusters))
        progress(f"links: gloo's all-reduce per wire dtype among {sizes} emulated nodes")
        links.update(measure_groups((cluster, *group_clusters)))
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


def refine(hw: Hardware, run_dirs: list[Path]) -> tuple[Hardware, list[dict[str, float]]]:
    """Refine `hw` from finished runs, each kind fixing its own constants (grey box):

    - single-replica runs (one worker, or tensor and pipeline parallel): measured = a * compute +
      (predicted - compute) + c, compute without a CPU's per-op dispatch (which efficiency does not
      scale); efficiency is divided by a and c added to `step_overhead_s`. One
      run fixes a alone (c = 0); two or more give both by least squares. Repeats of one
      configuration (the same predicted compute) count as one point, their median.
    - data-parallel runs (several replicas): `sync_overhead_s`, what a synchronous step costs past
      its compute, update and overhead and its own measured communication (`comm_seconds_per_step`),
      per core's share of the host (`strategies.host_slowdown`), the median over them
      (`sync_residual`). Medians, so that one run slowed by a busy stretch of a shared machine
      does not move the constants when there are three repeats or more. Two slow ones still do:
      two single-worker MLP runs at 16.5 and 15.7 ms, against 13.7-14.8 ms, once fitted the
      overhead 2 ms high and the sync cost to 0.
    - parameter-server runs: `ps.server_s_per_message` and `ps.server_s_per_update`
      (`server_cpu_per_message`), each averaged over the runs that measured it.
    - data-parallel runs with the priority scheduler: `piece_overhead_s`, what a piece costs
      past its all-reduce's calibrated latency, and `priority_overhead_s`, the
      scheduler's own cost a step per core's share of the host (`piece_residual`): from runs
      with two piece sizes or more, the slope and intercept of their residuals over their pieces;
      from one size, its residual over its pieces alone. Fitted after `sync_overhead_s`, which
      comes from the other data-parallel runs only.
    """
    summaries = {run: finished(run)[0] for run in run_dirs}
    ps_runs = [run for run in run_dirs if "servers_stats" in summaries[run]]
    points, dp_runs = [], []
    for run in run_dirs:
        if run in ps_runs:
            continue
        measured, pred = measured_and_predicted(run, hw)
        if pred.plan.dp > 1:
            dp_runs.append(run)
            continue
        _, arithmetic = measured_and_predicted(run, without_dispatch(hw))  # what efficiency scales
        points.append({"run": str(run), "measured_s": measured, "predicted_s": pred.step_s,
                       "compute_s": arithmetic.breakdown["compute"]})
    refined = _fit_compute(hw, points) if points else hw
    if ps_runs:
        per_message = [server_cpu_per_message(summaries[run], refined) for run in ps_runs]
        points += [{"run": str(run), **m} for run, m in zip(ps_runs, per_message, strict=True)]
        fitted = {key: statistics.fmean(m[name] for m in per_message if name in m)
                  for key, name in ((SERVER_PER_MESSAGE, "server_s_per_message"),
                                    (SERVER_PER_UPDATE, "server_s_per_update"))
                  if any(name in m for m in per_message)}
        refined = replace(refined, constants={**refined.constants,
                                              **{k: max(0.0, v) for k, v in fitted.items()}})
    priority = [run for run in dp_runs if finished(run)[1].comm.scheduler == "priority"]
    plain = [run for run in dp_runs if run not in priority]
    if plain:
        residuals = [sync_residual(run, summaries[run], refined) for run in plain]
        points += [{"run": str(run), **r} for run, r in zip(plain, residuals, strict=True)]
        value = statistics.median(r["sync_overhead_s"] for r in residuals)
        refined = replace(refined, constants={**refined.constants, SYNC_OVERHEAD: max(0.0, value)})
    if priority:
        residuals = [piece_residual(run, refined) for run in priority]
        points += [{"run": str(run), **r} for run, r in zip(priority, residuals, strict=True)]
        slope, intercept = _fit_line([(r["piece_units"], r["residual_s"]) for r in residuals])
        if slope < 0:  # noise: more pieces measured faster; what they share is left
            slope, intercept = 0.0, statistics.median(r["residual_s"] for r in residuals)
        share = statistics.median(r["host_share"] for r in residuals)
        refined = replace(refined, constants={**refined.constants, PIECE_OVERHEAD: slope,
                                              PRIORITY_OVERHEAD: max(0.0, intercept) / share})
    return refined, points


def piece_residual(run: Path, hw: Hardware) -> dict[str, float]:
    """A priority run's step past the model's without the scheduler's own costs, and the units
    `piece_overhead_s` is charged in there (its pieces: two predictions 1 ms apart)."""
    base = replace(hw, constants={**hw.constants, PIECE_OVERHEAD: 0.0, PRIORITY_OVERHEAD: 0.0})
    measured, pred = measured_and_predicted(run, base)
    _, unit = measured_and_predicted(run, replace(base, constants={**base.constants, PIECE_OVERHEAD: 1e-3}))
    per_unit = (unit.step_s - pred.step_s) / 1e-3
    if per_unit <= 0:
        raise UserError(f"{str(run)!r}: its plan sends no priority pieces the model can charge")
    return {"measured_s": measured, "predicted_s": pred.step_s, "piece_units": per_unit,
            "residual_s": measured - pred.step_s, "host_share": host_slowdown(hw, pred.plan)}


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of (x, y) points, repeats of an x as their median; one x: through 0."""
    repeats: dict[float, list[float]] = {}
    for x, y in points:
        repeats.setdefault(round(x, 12), []).append(y)
    xs, ys = list(repeats), [statistics.median(v) for v in repeats.values()]
    if len(xs) == 1:
        return ys[0] / xs[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return a, my - a * mx


def sync_residual(run: Path, summary: dict[str, Any], hw: Hardware) -> dict[str, float]:
    """A data-parallel run's step past what the model charges besides communication, with the
    communication the run measured (its time waiting for gradients, `comm_seconds_per_step`) in
    place of the predicted: the ranks waiting for the slowest at the step's synchronization, the
    engine's per-step work, the processes' contention for the host. Per core's share of the host
    (`strategies.host_slowdown`), as the overhead it adds to."""
    measured, pred = measured_and_predicted(run, hw)
    rest = pred.step_s - pred.breakdown["dp_comm_exposed"] - pred.breakdown.get("sync", 0.0)
    slow = host_slowdown(hw, pred.plan)
    residual = measured - summary["comm_seconds_per_step"] - rest
    return {"measured_s": measured, "comm_s": summary["comm_seconds_per_step"], "rest_s": rest,
            "sync_overhead_s": residual / slow}


def _fit_compute(hw: Hardware, points: list[dict[str, float]]) -> Hardware:
    # predicted compute -> the run's measured step less the rest of its prediction
    a, c = _fit_line([(p["compute_s"], p["measured_s"] - p["predicted_s"] + p["compute_s"]) for p in points])
    if a <= 0:
        raise UserError("the runs do not fit a positive compute scale; give runs with different models "
                        "or batch sizes")
    c = max(0.0, c)
    efficiency = {k: v / a for k, v in hw.device.efficiency.items()}
    top = max(efficiency.values())  # a fraction of peak stays <= 1: a faster machine raises the peak
    peak = {k: v * max(1.0, top) for k, v in hw.device.peak_flops.items()}
    efficiency = {k: v / max(1.0, top) for k, v in efficiency.items()}
    device = replace(hw.device, efficiency=efficiency, peak_flops=peak)
    overhead = hw.constants.get("step_overhead_s", 0.0) + c
    return replace(hw, device=device, constants={**hw.constants, "step_overhead_s": overhead})


def calibrate_once(threads: int, progress: Callable[[str], None], cluster=None) -> Path | None:
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
    hw, _ = calibrate(cluster=cluster, threads=threads,
                      name=f"{socket.gethostname()} ({links}, {threads} threads)",
                      progress=lambda what: progress(f"  measuring {what}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(hw.to_yaml())
    os.replace(staging, path)  # whole or absent, when two runs calibrate at once
    return path
