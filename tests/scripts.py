"""Run a script as a test: its own process group, stopped with SIGTERM (so emulated clusters come
down) on timeout, and a failure that shows what it printed."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> with this interpreter; assert it exits 0 within `timeout` seconds."""
    return run_command([sys.executable, str(ROOT / "benchmarks" / script), *args], timeout=timeout)


def run_command(cmd: list[str], *, timeout: float,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` (and whatever it starts) in a session of its own; assert it exits 0 within `timeout` s."""
    name = " ".join(Path(part).name if part.endswith(".py") else part for part in cmd[1:])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's cluster handler removes its namespaces
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"{name} ran past {timeout:.0f} s; it printed:\n"
                             f"{out[-2000:]}\n{err[-6000:]}") from None
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{err[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tagged_processes(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (a test's PARALOOM_TEST_TAG: its launchers, agents,
    forkservers and workers, which inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if tag.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found
