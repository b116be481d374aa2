"""Each torchrun attempt's keys apart in the elastic agent's store, for any script that imports paraloom.

Under torchrun (c10d rendezvous, `--standalone` included) a worker's `init_process_group()` meets
its peers in a store that the elastic agent hosts (`TORCHELASTIC_USE_AGENT_STORE=True`, at
MASTER_ADDR:MASTER_PORT), and the agent keeps that one store for the whole run: its keys outlive a
restart. torch names the default group's keys alike in every attempt (under `default_pg/`), so a
rank of a restarted attempt can read the address a rank of the failed one left there, and gloo
connects to a dead port (`connectFullMesh ... Connection refused`) or waits on it until the group's
timeout. One worker of PyTorch's DDP tutorial killed under `--max-restarts 1`: the restart failed in
10 of 20 runs with torch's DDP, in 4 of 10 with paraloom's drop-in before this prefix and in none of
20 after it (benchmarks/drop_in_restarts.py). torch's own `_create_c10d_store` once gave the agent's
store a prefix per attempt (`/worker/attempt_N`, from TORCHELASTIC_RESTART_COUNT); `isolate_attempts`
puts such a prefix back at that place, so a user's unchanged `init_process_group()` gets keys of its
attempt's own. It touches nothing outside a torchrun worker, nor a store elsewhere than the agent's.

All the ranks of an attempt must agree on its number: torchrun's agents count their restarts each
for itself, which agree while the nodes stay the same (one agent per node, all restarting together).
Where membership changes (`--nnodes MIN:MAX`), give every node `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`:
each rendezvous round then has a store of its own and no prefix is needed (nor added).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch.distributed as dist

# the module (torch.distributed's attribute of that name is its function `rendezvous`)
RENDEZVOUS = importlib.import_module("torch.distributed.rendezvous")


def attempt_prefix() -> str | None:
    """This worker's prefix in the agent's store ("paraloom/attempt-N"), or None where the store is
    not the agent's (outside torchrun, or a store per round)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"paraloom/attempt-{attempt}"


def _agent_port(port: int) -> bool:
    return str(port) == os.environ.get("MASTER_PORT")


def isolate_attempts() -> None:
    """From now on, the store `init_process_group()` makes at the agent's address (env:// or a tcp://
    URL naming MASTER_PORT) is prefixed with this attempt (`attempt_prefix`). Idempotent; a torch
    without the function leaves its stores as they are (the tests fail there, not a user's import)."""
    create = getattr(RENDEZVOUS, "_create_c10d_store", None)
    if create is None or getattr(create, "isolates_attempts", False):
        return

    @functools.wraps(create)
    def create_per_attempt(hostname, port, *args, **kwargs):
        store = create(hostname, port, *args, **kwargs)
        prefix = attempt_prefix()
        if prefix is None or not _agent_port(port):
            return store
        return dist.PrefixStore(prefix, store)

    create_per_attempt.isolates_attempts = True
    RENDEZVOUS._create_c10d_store = create_per_attempt
