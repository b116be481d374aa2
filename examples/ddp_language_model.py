"""An ordinary torch DDP training script: a small causal transformer on bytes of text.

    torchrun --standalone --nproc-per-node 2 examples/ddp_language_model.py --steps 20

The text is the source of Python's own `argparse` module, read as bytes. To train it with
paraloom, change one line: the DDP import below becomes `from paraloom import DataParallel as DDP`.
"""

import argparse
import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SEQ, BATCH, WIDTH = 32, 8, 32  # context, sequences per rank and micro-batch, model width


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.block = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=2 * WIDTH, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(WIDTH, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.block(self.embed(tokens) + self.pos, src_mask=mask, is_causal=True))


def load_text() -> torch.Tensor:
    return torch.tensor(list(Path(argparse.__file__).read_bytes()), dtype=torch.long)


def batch(text: torch.Tensor, rank: int, world: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of this rank: inputs and the next bytes as targets."""
    starts = [((index * world + rank) * BATCH + i) * 7 % (len(text) - SEQ - 1) for i in range(BATCH)]
    window = torch.stack([text[s: s + SEQ + 1] for s in starts])
    return window[:, :-1], window[:, 1:]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)


def train(steps: int = 6, optimizer: str = "adamw", accumulate: int = 1, save: str | None = None,
          ddp_options: dict | None = None, wrap_optimizer=None) -> dict[str, torch.Tensor]:
    """Train `steps` steps of `accumulate` micro-batches each; returns the final state dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    text = load_text()
    torch.manual_seed(0)
    model = DDP(TinyLM(), **(ddp_options or {}))
    opt = make_optimizer(optimizer, model.parameters())
    if wrap_optimizer is not None:  # e.g. paraloom.DistributedOptimizer, for updaters that own the step
        opt = wrap_optimizer(opt, model)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            inputs, targets = batch(text, rank, world, step * accumulate + micro)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)) / accumulate
                loss.backward()
        opt.step()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    if save is not None and rank == 0:
        torch.save(state, save)
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
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
