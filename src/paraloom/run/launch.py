"""Start local workers through torch's elastic agent (the engine behind torchrun)."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from paraloom.config import Config
from paraloom.config.choices import STRATEGY_ENTRIES
from paraloom.config.errors import WorkersFailed
from paraloom.run import prestart, worker


def elastic_run(fn: Callable[..., Any], args: tuple, *, nproc: int, host: str = "127.0.0.1",
                max_restarts: int = 0, start_method: str = "spawn") -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local workers; returns each rank's result.

    Rendezvous stays on `host` (loopback by default): nothing listens beyond this machine.
    `fn` must be importable (workers are spawned, or forked from a forkserver that imported
    `prestart.PRELOAD`) and set GLOO_SOCKET_IFNAME itself if needed. When a worker fails, the agent
    stops the others and starts all of them again, up to `max_restarts` times (each start sees
    TORCHELASTIC_RESTART_COUNT), forked from the same server.
    """
    if start_method == "forkserver":
        prestart.take()  # the server `paraloom train` started for this launch, or a new one
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint=f"{host}:0",
        local_addr=host, max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method)
    try:
        return elastic_launch(launch, fn)(*args)
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items(), key=_first_cause)
        cause = _cause(failure)
        raise WorkersFailed(f"worker rank {rank} failed (exit code {failure.exitcode})"
                            + (f": {cause}" if cause else ""), failure.exitcode) from None
    finally:
        if start_method == "forkserver":
            prestart.stop()


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
    results = elastic_run(worker.run, (cfg.to_dict(), str(run_dir), started_at,
                                       cfg.comm.interface or interface),
                          nproc=nproc, max_restarts=cfg.run.max_restarts,
                          start_method="forkserver" if fork else "spawn")
    return results[0]
