"""One rank of a run: joins the process group and trains.

Started by `paraloom train` through torch's elastic agent, or on many nodes by torchrun:
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m paraloom.run.worker CONFIG.yaml [--set section.key=value ...] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from paraloom.config import CommConfig, Config, load_config
from paraloom.config.choices import STRATEGY_ENTRIES
from paraloom.config.errors import UserError
from paraloom.run.agent_store import isolate_attempts
from paraloom.run.directory import new_run_dir
from paraloom.train import stopping
from paraloom.train.guards import PeerFailure, TooManyBadSteps


def pick_device(cfg: Config) -> torch.device:
    run = cfg.run
    if STRATEGY_ENTRIES[cfg.strategy].cpu_only:  # gloo on CPU only, so far (config refuses run.device=cuda)
        return torch.device("cpu")
    if run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("run.device=cuda but no CUDA device is visible; use run.device=cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return torch.device("cuda", cuda_index(local_rank, local_world, torch.cuda.device_count(),
                                               backend=cfg.comm.backend))
    return torch.device("cpu")


def cuda_index(local_rank: int, local_world: int, devices: int, *, backend: str) -> int:
    """The GPU of a node's `local_rank` among its `devices`: one each, or shared round-robin when
    the node runs more ranks than it has GPUs, which gloo allows and NCCL refuses."""
    if local_world > devices and backend in ("nccl", "auto"):
        raise UserError(f"NCCL needs a GPU per rank: {local_world} ranks on this node share {devices} "
                        f"GPU{'s' if devices != 1 else ''}; run at most {devices} per node, or set "
                        "comm.backend=gloo (gloo works on CUDA tensors, more slowly)")
    return local_rank % devices


def init_distributed(comm: CommConfig, device: torch.device, *, interface: str | None) -> None:
    """Join the default process group from the launcher's environment (RANK, WORLD_SIZE, ...)."""
    backend = comm.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("comm.backend=nccl needs run.device=cuda; use comm.backend=gloo on CPU")
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # gloo reads its interface here
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        # a collective past comm.timeout_s: the watchdog aborts the communicator and the training
        # thread's next collective raises, so the loop names the silent rank and stops or restarts
        # as under gloo (torch's default, 3, kills the process without a word); a user's value wins
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        # the loop's small control messages (run folder, health, checkpoint agreement) are host
        # tensors, which NCCL refuses: gloo carries those, NCCL every CUDA tensor
        backend = "cpu:gloo,cuda:nccl"
    # The elastic agent's store outlives a restart, and the keys gloo's first attempt left there
    # (each rank's address) would send the new ranks to dead ports (seen: a 25-minute hang in
    # connectFullMesh after a restart): every attempt gets keys of its own (agent_store.py; importing
    # paraloom did this already, as it does for a user's own script).
    isolate_attempts()
    dist.init_process_group(backend, timeout=timedelta(seconds=comm.timeout_s))


def run(config: dict[str, Any], run_dir: str | None, started_at: float,
        interface: str | None = None, stop_file: str | None = None) -> dict[str, Any]:
    """Elastic-agent entry: one rank's whole life, process group set up and torn down.

    A mistake a restart would repeat goes to `stop_file`, where the launcher watches for it
    (stopping.py); this rank then waits to be stopped with the others."""
    stopping.die_with_parent()
    stopping.quiet_on_interrupt()
    try:
        return _train_rank(config, run_dir, started_at, interface)
    except BaseException as exc:
        if stop_file and stopping.is_deterministic(exc):
            exit_process(stopping.stop_run(exc, int(os.environ.get("RANK", "0")), stop_file))
        raise


def _train_rank(config: dict[str, Any], run_dir: str | None, started_at: float,
                interface: str | None) -> dict[str, Any]:
    from paraloom.train import train  # the one loop; it picks the strategy (train/strategies/__init__.py)

    cfg = Config.from_dict(config)
    torch.set_num_threads(_threads_per_worker())
    device = pick_device(cfg)
    init_distributed(cfg.comm, device, interface=interface or cfg.comm.interface)
    try:
        return train(cfg, Path(run_dir) if run_dir else None, device=device, started_at=started_at)
    finally:
        dist.destroy_process_group()


def _threads_per_worker() -> int:
    """Share this node's cores among its workers; a launcher's OMP_NUM_THREADS wins."""
    from paraloom.config.sections import threads_per_worker

    return threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def main(argv: list[str] | None = None) -> int:
    """`python -m paraloom.run.worker CONFIG.yaml` under torchrun: every rank reads the same config."""
    started_at = time.time()
    parser = argparse.ArgumentParser(prog="python -m paraloom.run.worker")
    parser.add_argument("config", nargs="?", help="YAML config (same file on every node)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--run-dir", help="run directory on global rank 0 (default: a new one)")
    parser.add_argument("--started-at", type=float, help=argparse.SUPPRESS)  # the launcher's clock
    # `paraloom train` made or checked --run-dir, and holds its lock for the run's whole life
    parser.add_argument("--run-locked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started_at = args.started_at or started_at
    stopping.die_with_parent()
    stopping.quiet_on_interrupt()
    try:
        cfg = load_config(args.config, args.set)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate_world(world - (cfg.processes(0)))
        run_dir = None
        if int(os.environ.get("RANK", "0")) == 0:
            given = Path(args.run_dir) if args.run_dir else None
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            # under a user's own torchrun, rank 0 holds the run directory's lock until its process ends
            if given is not None and args.run_locked:
                run_dir = given
            elif given is not None and (restarted or (given / "checkpoints").is_dir()):
                from paraloom.run.directory import RunLock

                run_dir = given  # a restart, or --resume: the run continues in its directory
                RunLock(given, wait_s=30 if restarted else 0)  # a restart waits for the dead rank's loaders
            else:
                run_dir = new_run_dir(cfg, given, world=int(os.environ.get("WORLD_SIZE", "1")))
        _train_rank(cfg.to_dict(), str(run_dir) if run_dir else None, started_at, None)
    except (PeerFailure, TooManyBadSteps) as exc:  # said in full: a traceback would add nothing
        print(f"paraloom: rank {os.environ.get('RANK', '0')}: {exc}", file=sys.stderr)
        return 1  # a failure the elastic agent restarts from the last checkpoint (run.max_restarts)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not stopping.is_deterministic(exc):
            raise  # a collective whose peer went away: torchrun restarts the node
        # with `paraloom train` watching (an emulated cluster, local nodes) the run stops at once;
        # under a user's own torchrun the line is printed and torchrun decides
        rank = int(os.environ.get("RANK", "0"))
        return stopping.stop_run(exc, rank, os.environ.get(stopping.STOP_FILE_ENV))
    return 0


def exit_process(code: int) -> NoReturn:
    """End a torchrun worker process with `code`, skipping the interpreter's C++ teardown.

    A worker whose work is done (results written, process group destroyed) can still abort while
    the interpreter tears torch's C++ objects down ("terminate called without an active
    exception", SIGABRT; seen about one emulated run in ten on this 2-core machine). The elastic
    agent takes that for a failure and restarts the node while its peers have already finished,
    which hangs the run at the exit barrier. Python-level cleanup has run by now; only C++
    destructors are skipped.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
