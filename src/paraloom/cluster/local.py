"""Local nodes: `run.nodes=MIN..MAX` without a cluster runs MAX elastic agents on this machine, one a
node, over loopback, so that a node can be lost and can return as on a cluster."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from paraloom.cluster.emulated import stop_pids

TAG = "PARALOOM_LOCAL_NODES"  # in every process of these nodes' environment: how they are found again


class LocalNodes:
    """What `torchrun_on_cluster` needs of a cluster, for agents that all run here."""

    interface = "lo"
    # a lost agent leaves the rendezvous once it has missed 3 heartbeats a second apart (torch's
    # default: 5 s apart): agents on one machine are never slow to beat
    rdzv_conf = ",keep_alive_interval=1,keep_alive_max_attempt=3"

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.tag = uuid.uuid4().hex[:12]
        with socket.socket() as probe:  # a port free now for node 0's rendezvous store
            probe.bind(("127.0.0.1", 0))
            self.rdzv_port = probe.getsockname()[1]

    def address(self, node: int) -> str:
        return "127.0.0.1"

    def exec_prefix(self, node: int) -> list[str]:
        """Marks the agent, and so its workers, as this run's (see stop_processes)."""
        return ["env", f"{TAG}={self.tag}"]

    def describe(self) -> str:
        return f"{self.nodes} local nodes (an elastic agent each, on loopback)"

    def stop_processes(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process of these nodes (agents and workers, whatever session they are in);
        SIGKILL what outlives `grace_s`."""
        marker = f"{TAG}={self.tag}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:  # gone, or not ours to read
                    continue
        stop_pids(pids, grace_s)

    def __enter__(self) -> LocalNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_processes()
