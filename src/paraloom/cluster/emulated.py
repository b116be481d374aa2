"""EmulatedCluster: N network namespaces, each joined to a bridge namespace by a tbf-shaped veth.

    plm-NAME-n0 (eth0 10.98.0.1) ==veth== n0 [br0 in plm-NAME-br] n1 ==veth== (eth0 10.98.0.2) plm-NAME-n1

Each node's link is shaped to the same rate in both directions: a `tbf` qdisc on the node's
eth0 (egress, node -> bridge) and another on the bridge-side veth (bridge -> node). Every
cluster lives in its own namespaces, so the host's network is untouched and the clusters'
address ranges never meet. `netem` is not available on these kernels, so no latency is added.
Each node's /etc/hosts (`/etc/netns/plm-NAME-nI/hosts`, which `ip netns exec` mounts over it) is the
host's plus every node's address by name, so that looking a peer's address up finds it (c10d warns
once a connection where it cannot); the files go with the namespaces.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from paraloom.cluster.spec import ClusterSpec, check_name, format_rate
from paraloom.config.errors import UserError

PREFIX = "plm"
SUBNET = "10.98.0"  # the project's /24, private to each cluster's namespaces
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts the files of NETNS_ETC/NS over /etc's
_active: dict[str, EmulatedCluster] = {}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode:
        message = (proc.stderr or proc.stdout).strip()
        if "Operation not permitted" in message or "Permission denied" in message:
            raise UserError("the emulated cluster needs root or CAP_NET_ADMIN (network namespaces); "
                            "run as root")
        raise RuntimeError(f"ip {' '.join(args)} failed: {message}")
    return proc


def _namespaces() -> list[str]:
    if shutil.which("ip") is None:
        return []
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_clusters() -> dict[str, EmulatedCluster]:
    """Clusters that are up now, found by their namespaces."""
    found: dict[str, int] = {}
    for ns in _namespaces():
        match = re.fullmatch(rf"{PREFIX}-([a-z0-9]+)-n(\d+)", ns)
        if match:
            found[match.group(1)] = max(found.get(match.group(1), 0), int(match.group(2)) + 1)
    return {name: EmulatedCluster(ClusterSpec(nodes, _read_rate(name), name))
            for name, nodes in sorted(found.items()) if nodes >= 2}


def _owner_file(name: str) -> Path:
    """Where a cluster brought up for one command (`with EmulatedCluster(...)`, `--emulate`) records
    its owner: `PID START` (the process's start time, so that a reused PID is not taken for it)."""
    return NETNS_ETC / f"{PREFIX}-{name}-owner" / "pid"


def _started(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (/proc), or None where it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner(name: str) -> tuple[int, bool] | None:
    """(the PID that brought cluster `name` up, whether that command still runs); None where the
    cluster has no owner (`paraloom cluster up`)."""
    try:
        pid, started = _owner_file(name).read_text().split()
    except (OSError, ValueError):
        return None
    return int(pid), _started(int(pid)) == started


def live_owner(name: str) -> int | None:
    """The PID of the command that brought cluster `name` up and still runs; None where that command
    is gone or the cluster has no owner."""
    owner = _owner(name)
    return owner[0] if owner is not None and owner[1] else None


def orphaned_clusters() -> list[EmulatedCluster]:
    """Clusters whose owning command is gone (killed outright: it never took them down). Clusters
    of `paraloom cluster up` have no owner and are never orphaned."""
    return [cluster for name, cluster in list_clusters().items()
            if (owner := _owner(name)) is not None and not owner[1]]


def remove_orphans(say=None) -> list[str]:
    """Take every orphaned cluster down (their namespaces and whatever still runs in them)."""
    names = []
    for cluster in orphaned_clusters():
        cluster.down()
        names.append(cluster.name)
        if say is not None:
            say(f"removed emulated cluster {cluster.name}: the command that brought it up is gone")
    return names


def free_name(prefix: str) -> str:
    """`prefix` and the first number no cluster up now is called by: emu0, emu1, ..."""
    taken = list_clusters()
    name = next((f"{prefix}{i}" for i in range(1000) if f"{prefix}{i}" not in taken), None)
    if name is None:
        raise UserError(f"clusters {prefix}0 to {prefix}999 are all up; "
                        "take some down (`paraloom cluster down`)")
    return name


def _read_rate(name: str) -> int:
    out = _ip("netns", "exec", f"{PREFIX}-{name}-n0", "tc", "qdisc", "show", "dev", "eth0",
              check=False).stdout
    match = re.search(r"rate (\d+(?:\.\d+)?)([KMG]?)bit", out)
    if not match:
        return 0
    return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[match.group(2)])


def burst_bytes(rate_bits: int) -> int:
    """The token bucket every shaped link gets: 2 ms of traffic at its rate, at least 32 KiB."""
    return max(rate_bits // 8 // 500, 32 * 1024)


class EmulatedCluster:
    """Bring a cluster up and down; as a context manager it always comes down, on error or signal."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec

    @classmethod
    def attach(cls, name: str) -> EmulatedCluster:
        """The cluster `name`, which `paraloom cluster up` brought up earlier."""
        check_name(name)
        clusters = list_clusters()
        if name not in clusters:
            raise UserError(f"no emulated cluster {name!r} is up; start it with "
                            f"`paraloom cluster up --nodes 4 --bandwidth 1gbit --name {name}`")
        return clusters[name]

    interface = "eth0"  # each node's own link: gloo binds to it
    rdzv_port = 29400  # on node 0's address
    rdzv_conf = ""  # more of torch's rendezvous settings where the membership may change (torch's own)

    @property
    def nodes(self) -> int:
        return self.spec.nodes

    @property
    def name(self) -> str:
        return self.spec.name

    def namespace(self, node: int) -> str:
        return f"{PREFIX}-{self.name}-n{node}"

    @property
    def bridge_namespace(self) -> str:
        return f"{PREFIX}-{self.name}-br"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        """Prefix a command with this to run it inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def is_up(self) -> bool:
        return self.bridge_namespace in _namespaces()

    def up(self) -> EmulatedCluster:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise UserError(f"the emulated cluster needs `{tool}` (Debian package iproute2)")
        if any(ns.startswith(f"{PREFIX}-{self.name}-") for ns in _namespaces()):
            raise UserError(f"emulated cluster {self.name!r} is already up; "
                            f"`paraloom cluster down --name {self.name}` first, or pick another --name")
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        br = self.bridge_namespace
        _ip("netns", "add", br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.namespace(i), f"n{i}"
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", port, "netns", br, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", port, "master", "br0")
            _ip("-n", br, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")
            self._shape(br, port)
        self._write_hosts()

    def _write_hosts(self) -> None:
        hosts = Path("/etc/hosts")
        base = hosts.read_text().rstrip("\n") + "\n" if hosts.is_file() else "127.0.0.1 localhost\n"
        # IPv4, and IPv4-mapped IPv6 as a dual-stack socket (the rendezvous store's) sees its peers
        names = "".join(f"{prefix}{self.address(i)} {self.namespace(i)}\n"
                        for prefix in ("", "::ffff:") for i in range(self.nodes))
        for i in range(self.nodes):
            folder = NETNS_ETC / self.namespace(i)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(base + names)

    def _shape(self, ns: str, dev: str) -> None:
        rate = self.spec.rate_bits
        burst = burst_bytes(rate)
        _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{rate}bit", "burst", str(burst), "latency", "20ms")

    def stop_processes(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process inside the cluster's namespaces; SIGKILL what outlives `grace_s`."""
        pids = []
        for ns in self._own_namespaces():
            pids += [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        stop_pids(pids, grace_s)

    def _own_namespaces(self) -> list[str]:
        return [ns for ns in _namespaces() if ns.startswith(f"{PREFIX}-{self.name}-")]

    def down(self) -> None:
        """Stop every process inside the cluster and delete its namespaces (idempotent)."""
        self.stop_processes()
        for ns in self._own_namespaces():
            _ip("netns", "del", ns, check=False)
        for folder in NETNS_ETC.glob(f"{PREFIX}-{self.name}-*"):
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # where no other namespace keeps files there
            NETNS_ETC.rmdir()

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} nodes, {format_rate(self.spec.rate_bits)} links, "
                f"{self.address(0)}..{self.address(self.nodes - 1)}")

    def __enter__(self) -> EmulatedCluster:
        self.up()
        _active[self.name] = self
        _install_cleanup()
        owner = _owner_file(self.name)
        owner.parent.mkdir(parents=True, exist_ok=True)
        owner.write_text(f"{os.getpid()} {_started(os.getpid())}")
        return self

    def __exit__(self, *exc: object) -> None:
        _active.pop(self.name, None)
        self.down()


def stop_pids(pids: list[int], grace_s: float) -> None:
    """SIGTERM `pids`; SIGKILL those that outlive `grace_s`."""
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    _signal_all(pids, signal.SIGKILL)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


_installed = False


def _install_cleanup() -> None:
    """Clusters opened with `with` come down at exit and on SIGTERM/SIGHUP, not only on errors."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(lambda: [c.down() for c in list(_active.values())])
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _raise_exit)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `with EmulatedCluster(...)`, which cleans up
