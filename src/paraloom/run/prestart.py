"""The forkserver CPU workers fork from: started while the launcher still imports, stopped at once.

A local CPU run's workers fork from a forkserver that imported the training stack (`PRELOAD`:
torch, its distributed stack, dynamo, the loop) once. Those imports took about 2.5 s of every
4-step run's 11 s, after the launcher's own imports of torch, which took as long. `start` sets
the server going before the launcher imports anything heavy, so the two import side by side;
`launch.elastic_run` takes the server it finds started for it. Torch-free, so that `paraloom
train` can call it first.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import signal

# orphan_guard first: the server dies with the launcher even while it imports the rest
PRELOAD = ["paraloom.run.orphan_guard", "paraloom.run.worker", "paraloom.train.loop"]

_fresh = False  # the running server was started for the next launch and has served none yet


def start() -> None:
    """Start a forkserver for the next launch of CPU workers in this process (any earlier one
    stopped: it holds its launch's environment). Returns at once; the server imports `PRELOAD`
    in its own process, and a launch's first fork waits for it."""
    global _fresh
    stop()
    if "forkserver" not in multiprocessing.get_all_start_methods():  # as on Windows: workers spawn
        return
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    _fresh = True


def take() -> None:
    """Before a launch that forks its workers: keep the server `start` made for it, or stop one an
    earlier launch left (the launch then starts its own, with this moment's environment)."""
    global _fresh
    if not _fresh:
        stop()
    multiprocessing.set_forkserver_preload(PRELOAD)
    _fresh = False


def stop() -> None:
    """Stop this process's forkserver, if one runs, and reap it: nothing of a launch outlives it.

    Asked to stop, the server leaves through SystemExit, and tearing down the torch it preloaded
    took 0.9 s, every launch's last second. It holds nothing but its listening socket (its workers
    have exited by then, and were never its to stop), so it is killed first; CPython's `_stop`
    (what its own tests stop it with) then reaps it and removes the socket as it would have."""
    global _fresh
    _fresh = False
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    halt = getattr(server, "_stop", None)
    if halt is None:
        return
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    halt()


def gpu_visible() -> bool:
    """Whether this machine shows a GPU device file (NVIDIA or ROCm), without importing torch: a
    run that may go to GPUs spawns its workers, and starts no forkserver early."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))
