"""Asynchronous parameter-server workers as a closed queueing network, solved by mean value analysis.

Under ASP (and SSP while no worker reaches the staleness bound) workers do not wait for each
other: each loops compute -> push -> pull, and their pushes and pulls meet at the servers'
links in whatever phase they drift into. Neither the lock-step BSP sum (every push at once, then
every pull) nor a perfect stagger (one worker pulls while another pushes) describes that; the
exact mean value analysis of a closed network with `workers` customers does (Reiser & Lavenberg
1980, "Mean-Value Analysis of Closed Multichain Queuing Networks", J. ACM 27(2)): queueing
stations are the servers' inbound and outbound links (a worker's own link carries only its own
traffic, so it is delay, not queueing), and the worker's compute is a delay station.
"""

from __future__ import annotations

from collections.abc import Sequence


def mva_cycle(customers: int, demands: Sequence[float], delay: float) -> float:
    """Mean seconds per cycle of one of `customers` circulating through queueing stations with the
    given service demands (seconds per visit) and a delay station of `delay` seconds (exact MVA)."""
    if customers < 1:
        raise ValueError(f"customers={customers} must be at least 1")
    queue = [0.0] * len(demands)
    cycle = delay + sum(demands)
    for n in range(1, customers + 1):
        residence = [d * (1.0 + q) for d, q in zip(demands, queue, strict=True)]
        cycle = delay + sum(residence)
        throughput = n / cycle
        queue = [throughput * r for r in residence]
    return cycle


def asp_cycle(workers: int, servers: int, push_s: float, pull_s: float, worker_s: float,
              slices: int = 1, server_cpu_s: float = 0.0) -> float:
    """Seconds per step of one asynchronous worker.

    `push_s`/`pull_s`: one worker's whole push or pull through one link (its bytes over the
    bandwidth). A push goes to all `servers` shards at once, so the servers' inbound links act as
    one station of `servers` times the capacity (demand push_s / servers), and likewise outbound;
    the rest of a transfer is the worker's own link, which only it uses: delay, as are its compute
    and overhead (`worker_s`). With `slices` > 1 messages per shard a worker's pull of one slice
    overlaps its push of the next, so its push and pull visit the servers' links as one station
    whose demand is the longer transfer and the last slice of the shorter (as `network.ps_time`).
    `server_cpu_s`: the CPU seconds the servers spend on one worker's push and pull (moving its
    bytes, handling its messages). With one message a shard it is one more station, after the
    link; with `slices` > 1 a server's receiving threads take in the next slice while it handles
    the last, so its link and CPU are one station too: the longer of the two and a slice of the
    shorter (BSP's model takes the longer of the two whole, `ps_sync.ps_bsp_sync`).
    """
    cpu = [server_cpu_s] if server_cpu_s > 0 else []
    if slices <= 1:
        demands = [push_s / servers, pull_s / servers]
        own = (push_s - push_s / servers) + (pull_s - pull_s / servers)
        return mva_cycle(workers, demands + cpu, worker_s + own)
    both = max(push_s, pull_s) + min(push_s, pull_s) / slices
    link = both / servers
    station = max(link, server_cpu_s) + min(link, server_cpu_s) / slices
    return mva_cycle(workers, [station], worker_s + both - link)
