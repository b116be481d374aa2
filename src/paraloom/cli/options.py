"""Options more than one command shares: where a command runs (--cluster NAME / --emulate NODESxRATE)."""

from __future__ import annotations

import contextlib
import sys

from paraloom.config.errors import UserError


@contextlib.contextmanager
def cluster_from_options(name: str | None, emulate: str | None, *, local_nodes: int | None = None):
    """The cluster a command runs on: none (loopback), an existing one, or one made for it; without
    either, `local_nodes` agents on this machine (run.nodes), if given."""
    if name and emulate:
        raise UserError("give --cluster or --emulate, not both")
    if name or emulate:  # clusters a killed command left behind go before another one is used
        from paraloom.cluster.emulated import remove_orphans

        remove_orphans(say=lambda line: print(f"paraloom: {line}", file=sys.stderr))
    if emulate is None:
        if name is None and local_nodes is not None:
            from paraloom.cluster.local import LocalNodes

            with LocalNodes(local_nodes) as local:
                yield local
            return
        if name is None:
            yield None
            return
        from paraloom.cluster import EmulatedCluster

        yield EmulatedCluster.attach(name)
        return
    from paraloom.cluster import EmulatedCluster, free_name, parse_emulate

    spec = parse_emulate(emulate, name=free_name("emu"))
    with EmulatedCluster(spec) as made:
        yield made


def link_timers():
    """What `paraloom calibrate` times links with, handed to the performance model: the collectives
    benchmark's all-reduce sweeps and the emulated cluster's one-stream link test."""
    from paraloom.bench.allreduce_sweep import run_collectives
    from paraloom.cluster.emulated import burst_bytes
    from paraloom.cluster.torchrun import link_throughput
    from paraloom.perfmodel.measure.calibrate import LinkTimers

    return LinkTimers(collectives=run_collectives, stream_mb_s=link_throughput, burst_bytes=burst_bytes)
