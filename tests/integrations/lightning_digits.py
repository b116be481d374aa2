"""Fit a small LightningModule on digits with 2 CPU processes; rank 0 saves the final parameters.

    python tests/integrations/lightning_digits.py --strategy paraloom|ddp --out DIR [--steps N] [--hook NAME]

Lightning re-launches this script once per extra process (MASTER_ADDR / MASTER_PORT from the
environment). The data keep their order (no shuffle): Lightning's DistributedSampler splits them.
"""

import argparse
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.data import load_dataset


class DigitsMLP(pl.LightningModule):
    def __init__(self, n_in: int, n_classes: int, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(n_in, 32), nn.ReLU(), nn.Linear(32, n_classes))
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def make_strategy(name: str, options: dict):
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    from paraloom.integrations.lightning import ParaloomStrategy

    return ParaloomStrategy(**options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["paraloom", "ddp"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--scheduler", default=None, help="paraloom's scheduler= (paraloom only)")
    parser.add_argument("--compressor", default=None, help="paraloom's compressor= (paraloom only)")
    parser.add_argument("--hook", default=None, help="a paraloom DDP comm hook, through CommHookCallback")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    split = load_dataset("digits")
    data = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=32, shuffle=False)
    pl.seed_everything(0, verbose=False)
    model = DigitsMLP(split.x_train[0].numel(), split.n_classes, lr=0.1)
    options = {k: v for k, v in (("scheduler", args.scheduler), ("compressor", args.compressor)) if v}
    callbacks = []
    if args.hook:
        from paraloom.integrations.lightning import CommHookCallback

        callbacks.append(CommHookCallback(args.hook))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=make_strategy(args.strategy, options),
                         callbacks=callbacks,
                         max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, deterministic=True)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"state_dict": model.state_dict(), "losses": model.losses,
                  "hook_bytes": callbacks[0].state.bytes if callbacks else 0}
        torch.save(result, args.out / f"{args.strategy}.pt")


if __name__ == "__main__":
    main()
