"""Start local workers through torch's elastic agent (the engine behind torchrun)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from paraloom.config import Config
from paraloom.config.choices import STRATEGY_ENTRIES
from paraloom.config.errors import Interrupted, UserError, WorkersFailed
from paraloom.run import prestart, worker
from paraloom.train import stopping

SHUTDOWN_TIMEOUT_S = 5


def _takes(field: str) -> bool:
    """Whether this torch's LaunchConfig has `field` (shutdown_timeout: not in every torch >= 2.4)."""
    return field in {f.name for f in dataclasses.fields(LaunchConfig)}


def elastic_run(fn: Callable[..., Any], args: tuple, *, nproc: int, host: str = "127.0.0.1",
                max_restarts: int = 0, start_method: str = "spawn",
                stop_file: Path | None = None) -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local workers; returns each rank's result.

    Rendezvous stays on `host` (loopback by default): nothing listens beyond this machine.
    `fn` must be importable (workers are spawned, or forked from a forkserver that imported
    `prestart.PRELOAD`) and set GLOO_SOCKET_IFNAME itself if needed. When a worker fails, the agent
    stops the others and starts all of them again, up to `max_restarts` times (each start sees
    TORCHELASTIC_RESTART_COUNT), forked from the same server. A rank that writes `stop_file` (a
    mistake a restart would repeat: run/stopping.py) has every worker stopped at once, no restart, and
    its line raised as a UserError; SIGINT or SIGTERM stops them all and raises `Interrupted`.
    """
    if start_method == "forkserver":
        prestart.take()  # the server `paraloom train` started for this launch, or a new one
    # a worker that ignores the agent's SIGTERM (stopped, or stuck in C) is killed after this many
    # seconds, not torch's default 30 (its peers have given up on it by then)
    stopping_after = {"shutdown_timeout": SHUTDOWN_TIMEOUT_S} if _takes("shutdown_timeout") else {}
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint=f"{host}:0",
        local_addr=host, max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method,
        **stopping_after)
    watching = (stopping.watch_stop_file(stop_file, stopping.signal_self) if stop_file is not None
                else contextlib.nullcontext())
    try:
        with watching, _quiet_agent():
            return elastic_launch(launch, fn)(*args)
    except SignalException as exc:  # the agent stopped every worker first
        line = stopping.read_stop(stop_file)
        if line is not None:
            raise UserError(line) from None
        raise Interrupted("interrupted", int(exc.sigval)) from None
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items(), key=_first_cause)
        cause = _cause(failure)
        raise WorkersFailed(f"worker rank {rank} failed (exit code {failure.exitcode})"
                            + (f": {cause}" if cause else ""), failure.exitcode) from None
    finally:
        if start_method == "forkserver":
            prestart.stop()


@contextlib.contextmanager
def _quiet_agent():
    """The agent's own warnings (a death signal received, workers being stopped) say nothing the
    launcher's one line does not: kept off the terminal while it runs. The signal handlers it puts
    in place (each signal raising its SignalException) are taken away when it is done."""
    logs = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
            if name.startswith("torch.distributed.elastic")]  # each has a level of its own
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS} if main else {}
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


_AGENT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                       if hasattr(signal, name))


def _first_cause(item: tuple[int, Any]) -> tuple[int, int]:
    """Order failures: ranks that raised an error of their own before ranks that were killed."""
    rank, failure = item
    return (0 if _cause(failure) else 1, rank)


def _cause(failure: Any) -> str:
    """The last line of a failed worker's error (its exception type and message), if recorded."""
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip() or message.startswith("Signal"):
        return ""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else ""


def launch_local(cfg: Config, run_dir: Path, *, started_at: float,
                 interface: str = "lo") -> dict[str, Any]:
    """Train with `cfg.parallel.nproc` workers on this machine; returns rank 0's summary."""
    nproc = cfg.processes(cfg.parallel.nproc)
    gpus = cfg.run.device != "cpu" and torch.cuda.is_available()
    if not STRATEGY_ENTRIES[cfg.strategy].cpu_only and gpus:
        worker.cuda_index(nproc - 1, nproc, torch.cuda.device_count(), backend=cfg.comm.backend)  # refuses
    # CPU workers fork from a forkserver where the platform has one; GPU workers are spawned, so
    # that no import a preload makes can touch CUDA before a worker's fork
    fork = not gpus and "forkserver" in multiprocessing.get_all_start_methods()
    with tempfile.TemporaryDirectory(prefix="paraloom-stop-") as folder:
        stop_file = Path(folder) / "stop.json"
        results = elastic_run(worker.run, (cfg.to_dict(), str(run_dir), started_at,
                                           cfg.comm.interface or interface, str(stop_file)),
                              nproc=nproc, max_restarts=cfg.run.max_restarts,
                              start_method="forkserver" if fork else "spawn", stop_file=stop_file)
    return results[0]
