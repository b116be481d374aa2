"""Run a module on every node of an emulated cluster (one torchrun, an elastic agent, per namespace)
or on local nodes (one agent per node on this machine's loopback)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from paraloom.cluster.emulated import EmulatedCluster
from paraloom.cluster.local import LocalNodes
from paraloom.config.errors import Interrupted, UserError, WorkersFailed
from paraloom.train.stopping import STOP_FILE_ENV, read_stop

# Benchmarks measure from scratch on every attempt, so a worker that fails at start-up (seen once
# in CI on a loaded machine, cause not captured) costs a retry, not the run.
BENCH_RESTARTS = 1


def torchrun_on_cluster(cluster: EmulatedCluster | LocalNodes, module_args: list[str], *, log_dir: Path,
                        nproc_per_node: int = 1, max_restarts: int = 0, min_nodes: int | None = None,
                        lost: dict[int, float | None] | None = None) -> None:
    """Start `python -m torch.distributed.run ... -m MODULE ARGS` in every node's namespace.

    Rendezvous is on node 0's address; gloo binds to each node's eth0, so every byte between
    workers crosses the shaped links. Node 0's output goes to this terminal, the others' to
    `log_dir/node<i>.log`. Returns when all nodes finish; a failure or an interrupt stops every
    process on the cluster, and so does a mistake a restart would repeat, which a worker writes to
    the run's stop file (train/stopping.py) and this raises as a UserError. The agents run in sessions
    of their own (a Ctrl-C reaches this launcher alone, which stops them) and die with it. With
    `min_nodes` the membership may change (torchrun's --nnodes MIN:MAX): the nodes of `lost` (node:
    seconds until it starts again, or None) may die while the others go on; one that comes back
    joins at the survivors' next rendezvous.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // (cluster.nodes * nproc_per_node))
    run_id = uuid.uuid4().hex[:12]
    nnodes = f"{min_nodes}:{cluster.nodes}" if min_nodes is not None else str(cluster.nodes)
    # once MIN nodes have joined a rendezvous round, it waits this long for the others: long enough
    # for every node of a starting cluster to join (on a loaded machine some start seconds late), and
    # all a shrunk run waits for a lost node
    last_call = f",last_call_timeout=10{cluster.rdzv_conf}" if min_nodes is not None else ""
    procs, logs = [], []
    stop_dir = tempfile.TemporaryDirectory(prefix="paraloom-stop-")
    stop_file = Path(stop_dir.name) / "stop.json"
    # the kernel kills an agent whose launcher died (its workers then die with it: stopping.die_with_parent)
    orphan_guard = ["setpriv", "--pdeathsig", "SIGKILL", "--"] if shutil.which("setpriv") else []

    def start(node: int) -> subprocess.Popen:
        cmd = [*cluster.exec_prefix(node), *orphan_guard, sys.executable, "-m", "torch.distributed.run",
               f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.address(0)}:{cluster.rdzv_port}",
               f"--rdzv-id={run_id}", f"--local-addr={cluster.address(node)}",
               # node 0 hosts the rendezvous store: its name resolves to loopback, so torch
               # cannot tell by itself that the endpoint address is its own
               f"--rdzv-conf=is_host={int(node == 0)}{last_call}",
               f"--max-restarts={max_restarts}", "-m", *module_args]
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: every rendezvous round's workers get a store of their
        # own, on a port rank 0 picks afresh: no key of an earlier round can mislead them, and no key
        # prefix is needed that all ranks agree on (the agents' restart counts differ once a healthy
        # node restarts for a membership change, which does not count as a restart)
        env = dict(os.environ, GLOO_SOCKET_IFNAME=cluster.interface, OMP_NUM_THREADS=str(threads),
                   PARALOOM_NODE=str(node), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   **{STOP_FILE_ENV: str(stop_file)})
        # a worker that ignores its agent's SIGTERM (stopped, stuck in C) is killed after 5 s, not 30
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
        log = logs[node]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                start_new_session=True)

    try:
        for node in range(cluster.nodes):
            logs.append(None if node == 0 else (log_dir / f"node{node}.log").open("a"))
            procs.append(start(node))
        _wait_all(procs, log_dir, lost or {}, start, run_dir=log_dir.parent, stop_file=stop_file)
    except BaseException as exc:
        # failed, interrupted or stopped: nothing of this run may keep running, whatever state
        # torchrun is in. An interrupted or stopped agent is killed outright (asked to stop, it would
        # print its own traceback on node 0's terminal); its workers die with it, and whatever is
        # left in the cluster's namespaces is stopped below
        quietly = isinstance(exc, (KeyboardInterrupt, Interrupted, UserError))
        for proc in procs:
            if proc.poll() is None:
                proc.kill() if quietly else proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cluster.stop_processes()
        raise
    finally:
        for log in logs:
            if log is not None:
                log.close()
        stop_dir.cleanup()


def _wait_all(procs: list[subprocess.Popen], log_dir: Path, lost: dict[int, float | None] | None = None,
              start=None, *, run_dir: Path | None = None, stop_file: Path | None = None) -> None:
    """Until every node is done; a node of `lost` that dies is let go (and started again, once, its
    seconds after the others have gone on without it), any other failure stops the run, and so does
    a line in `stop_file` (raised as a UserError)."""
    from paraloom.train.checkpoint.records import read_resumes

    lost = {} if lost is None else lost
    back_at: dict[int, float] = {}
    waiting: dict[int, tuple[float, int]] = {}  # node: (seconds, resizes on record when it was lost)
    started_again: set[int] = set()
    while True:
        stopped = read_stop(stop_file)
        if stopped is not None:
            raise UserError(stopped)
        codes = [p.poll() for p in procs]
        pending = started_again | set(waiting) | set(back_at)
        if pending and all(c == 0 for i, c in enumerate(codes) if i not in pending):
            for node in started_again:  # the run ended before a node that came back could join it
                if codes[node] is None:
                    procs[node].terminate()
                    procs[node].wait()
            return
        for node in [i for i, c in enumerate(codes) if c not in (None, 0) and i in lost]:
            again = lost.pop(node)
            print(f"paraloom: node {node} lost (its agent exited with {codes[node]})"
                  + (f"; it starts again {again:g} s after the others go on without it" if again is not None
                     else ""), file=sys.stderr)
            if again is not None:
                waiting[node] = (again, len(read_resumes(run_dir)["resizes"]))
            codes[node] = 0 if again is None else None
            procs[node] = _Done() if again is None else procs[node]
        for node, (again, resizes) in list(waiting.items()):
            codes[node] = None
            if len(read_resumes(run_dir)["resizes"]) > resizes:  # the survivors went on without it
                del waiting[node]
                back_at[node] = time.monotonic() + again
        for node, when in list(back_at.items()):
            if time.monotonic() >= when:
                del back_at[node]
                procs[node] = start(node)
                started_again.add(node)
                print(f"paraloom: node {node} starts again", file=sys.stderr)
            codes[node] = None
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            node, code = failed[0]
            if node == 0:
                raise WorkersFailed(f"node 0 failed (exit code {code}); its output is above", code)
            log = log_dir / f"node{node}.log"
            raise WorkersFailed(f"node {node} failed (exit code {code}); its output is {log}, "
                                f"which ends:\n{_tail(log)}", code)
        if all(c == 0 for c in codes):
            return
        time.sleep(0.1)


class _Done:
    """A node let go: it counts as finished."""

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def terminate(self) -> None:
        pass

    kill = terminate


def _tail(path: Path, lines: int = 25) -> str:
    """The last lines of a node's log (the log may live in a directory about to be removed)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(unreadable)"
    return "\n".join(text.splitlines()[-lines:])


def link_throughput(cluster: EmulatedCluster | None, nbytes: int, *, repeats: int = 3) -> list[float]:
    """MB/s of one TCP stream from node 0 to node 1 (over loopback when `cluster` is None), per repeat."""
    return [_one_stream(cluster, nbytes, 5201 + i) for i in range(repeats)]


def _one_stream(cluster: EmulatedCluster | None, nbytes: int, port: int) -> float:
    host = cluster.address(1) if cluster else "127.0.0.1"
    prefix = (lambda node: cluster.exec_prefix(node)) if cluster else (lambda node: [])
    base = [sys.executable, "-m", "paraloom.cluster.linktest"]
    receiver = subprocess.Popen([*prefix(1), *base, "recv", host, str(port), str(nbytes)],
                                stdout=subprocess.PIPE, text=True)
    try:
        subprocess.run([*prefix(0), *base, "send", host, str(port), str(nbytes)], check=True,
                       timeout=120)
        out, _ = receiver.communicate(timeout=60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return float(json.loads(out)["MBps"])
