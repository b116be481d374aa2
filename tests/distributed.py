"""Fork N gloo (or NCCL) workers over a FileStore; bring each rank's result (or its failure) to pytest."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _leave_together(store: dist.Store, world_size: int, ok: bool, timeout: float) -> None:
    """Tear the group down only once every rank is done (or one failed): a rank that ran no
    collective could otherwise close its sockets while a peer is still connecting to them, and the
    peer would fail with "connectFullMesh ... Connection closed by peer"."""
    if not ok:
        store.set("failed", "1")
    store.add("left", 1)
    deadline = time.monotonic() + timeout
    while store.add("left", 0) < world_size and not store.check(["failed"]) and time.monotonic() < deadline:
        time.sleep(0.005)


def _worker(rank: int, world_size: int, store_path: str, results, fn: Callable, args, kwargs,
            timeout: float, backend: str) -> None:
    ok = False
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args, **kwargs)
            # plain pickle copies tensor bytes; the queue's own pickler would share memory through
            # file descriptors that die with this process
            results.put((rank, True, pickle.dumps(out)))
            ok = True
        finally:
            _leave_together(store, world_size, ok, timeout)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach pytest
        if not ok:
            results.put((rank, False, traceback.format_exc()))


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked ranks; return results by rank.

    A rank that raises fails the test with its traceback; a rank that hangs past `timeout`
    is killed and named. No process outlives the call. `backend="nccl"`: rank r on GPU r (the
    parent must not have touched CUDA: a forked child could not); results must hold no CUDA tensor.
    """
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="paraloom-test-")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, os.path.join(tmp, "store"), results, fn, args, kwargs,
                               timeout, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout + 10
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                # a rank killed hard (signal, os._exit) never reports: stop waiting for it
                crashed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if crashed and all(r not in outcome for r in crashed):
                    break
                continue
            outcome[rank] = (ok, payload)
            if not ok:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcome) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    failed = {r: tb for r, (ok, tb) in outcome.items() if not ok}
    if failed:
        rank = min(failed)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{failed[rank]}")
    missing = sorted(set(range(world_size)) - outcome.keys())
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} of {world_size} gave no result (exit codes {codes})")
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]  # our own children's output
