"""Shared test setup: torch.testing warmed once for forked ranks; no network namespace outlives the run."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.testing

sys.path.insert(0, str(Path(__file__).parent))  # tests/distributed.py is importable as `distributed`

torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

# runs predict themselves only where a test asks (run.hardware=...): pricing every run would cost the
# suite minutes, and calibrating this machine on first use 15 s a process
os.environ["PARALOOM_HARDWARE"] = "none"
# and the history of runs (`paraloom history`) and cached profiles go to a folder of the test session's
os.environ["PARALOOM_CACHE_DIR"] = tempfile.mkdtemp(prefix="paraloom-test-cache-")
atexit.register(shutil.rmtree, os.environ["PARALOOM_CACHE_DIR"], ignore_errors=True)

# ask NVML whether a GPU is there, without initialising CUDA here: forked workers could not use it after
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
CUDA_UNUSABLE = None if torch.cuda.is_available() else \
    f"no CUDA device visible to torch {torch.__version__} (`make test-gpu` runs these on a GPU machine)"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _netns_usable() -> str | None:
    """None when network namespaces can be made here, else the reason they cannot."""
    probe = f"plm-probe{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if made.returncode:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


NETNS_UNUSABLE = _netns_usable()


def pytest_collection_modifyitems(config, items):
    if CUDA_UNUSABLE:
        skip_cuda = pytest.mark.skip(reason=f"cuda: {CUDA_UNUSABLE}")
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip_cuda)
    if NETNS_UNUSABLE:
        skip = pytest.mark.skip(reason=f"netns: {NETNS_UNUSABLE}")
        for item in items:
            if "netns" in item.keywords:
                item.add_marker(skip)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _ours(namespace: str) -> bool:
    """Whether this session may take `namespace` down: its cluster's owner is gone or is this
    process's descendant; a cluster another live command (another checkout's tests) brought up is
    not ours, and one without an owner (`paraloom cluster up`) is taken as ours."""
    import re

    from paraloom.cluster.emulated import live_owner

    match = re.fullmatch(r"plm-([a-z0-9]+)-(?:n\d+|br)", namespace)
    owner = live_owner(match.group(1)) if match else None
    return owner is None or _descends_from(owner, os.getpid())


@pytest.fixture(scope="session", autouse=True)
def no_namespace_survives():
    """Fail the run, after removing them, if tests left emulated-cluster namespaces behind."""
    before = _namespaces() if not NETNS_UNUSABLE else set()
    yield
    if NETNS_UNUSABLE:
        return
    left = sorted(ns for ns in _namespaces() - before if ns.startswith("plm-") and _ours(ns))
    for ns in left:  # stop what still runs there (it would slow every later test), then remove
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        subprocess.run(["kill", "-9", *pids], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert not left, f"tests left network namespaces behind: {left}"
