"""An ordinary torch DDP training script: a small classifier on scikit-learn's digits.

    torchrun --standalone --nproc-per-node 2 examples/ddp_classifier.py --steps 20

To train it with paraloom, change one line: the DDP import below becomes
`from paraloom import DataParallel as DDP`. Nothing else changes (the tests run both and compare).
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH = 16  # per rank and micro-batch


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Linear(48, 10))


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    return torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target)


def batch(x, y, rank: int, world: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of this rank: rank-strided slices of a fixed order."""
    start = (index * world + rank) * BATCH % (len(x) - BATCH)
    return x[start: start + BATCH], y[start: start + BATCH]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def train(steps: int = 6, optimizer: str = "sgd", accumulate: int = 1, save: str | None = None,
          ddp_options: dict | None = None, wrap_optimizer=None) -> dict[str, torch.Tensor]:
    """Train `steps` steps of `accumulate` micro-batches each; returns the final state dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = load_data()
    torch.manual_seed(0)
    model = DDP(build_model(), **(ddp_options or {}))
    opt = make_optimizer(optimizer, model.parameters())
    if wrap_optimizer is not None:  # e.g. paraloom.DistributedOptimizer, for updaters that own the step
        opt = wrap_optimizer(opt, model)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            xb, yb = batch(x, y, rank, world, step * accumulate + micro)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(xb), yb) / accumulate
                loss.backward()
        opt.step()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    if save is not None and rank == 0:
        torch.save(state, save)
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save", default=None, help="rank 0 saves model.module.state_dict() here")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = train(args.steps, args.optimizer, args.accumulate, args.save)
    if dist.get_rank() == 0:
        print(f"trained {args.steps} steps on {dist.get_world_size()} ranks; "
              f"parameter sum {sum(float(v.sum()) for v in state.values()):.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
