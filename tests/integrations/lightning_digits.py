"""Fit a small LightningModule on digits with 2 CPU processes, once per FIT; rank 0 saves each fit's
final parameters, losses and validation count to DIR/results.pt.

    python tests/integrations/lightning_digits.py --package lightning|pytorch_lightning --out DIR FIT...

FIT is a strategy and its settings, `name[:key=value,...]`: name `ddp` (Lightning's DDPStrategy on
gloo), `paraloom` (a ParaloomStrategy instance) or `by-name` (`strategy="paraloom"`); keys `steps`,
`accumulate`, `val_every` (batches between validation runs, 0 for none), `scheduler` and `compressor`
(paraloom's), `hook` (a paraloom DDP comm hook, through CommHookCallback).

Lightning re-launches this script once per extra process at the first fit (MASTER_ADDR / MASTER_PORT
from the environment); later fits reuse the processes and their group. The data keep their order (no
shuffle): Lightning's DistributedSampler splits them.
"""

import argparse
import importlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.data import load_dataset

DEFAULTS = {"steps": 15, "accumulate": 1, "val_every": 0, "scheduler": None, "compressor": None, "hook": None}


def parse_fit(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    settings = dict(DEFAULTS)
    for item in filter(None, rest.split(",")):
        key, value = item.split("=")
        settings[key] = int(value) if isinstance(DEFAULTS[key], int) else value
    return name, settings


def module_class(pl):
    class DigitsMLP(pl.LightningModule):
        def __init__(self, n_in: int, n_classes: int, lr: float) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(n_in, 32), nn.ReLU(), nn.Linear(32, n_classes))
            self.lr = lr
            self.losses: list[float] = []
            self.validated = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.validated += 1
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    return DigitsMLP


def fit(pl, bridge, name: str, settings: dict, split) -> dict:
    options = {key: settings[key] for key in ("scheduler", "compressor") if settings[key]}
    if name == "ddp":
        strategy = pl.strategies.DDPStrategy(process_group_backend="gloo")
    elif name == "paraloom":
        strategy = bridge.ParaloomStrategy(**options)
    else:
        assert name == "by-name" and not options, "by-name takes the registry's defaults"
        strategy = "paraloom"
    callbacks = [bridge.CommHookCallback(settings["hook"])] if settings["hook"] else []
    validation = {}
    if settings["val_every"]:
        validation = {"val_dataloaders": DataLoader(TensorDataset(split.x_test, split.y_test), batch_size=64),
                      "val_check_interval": settings["val_every"], "limit_val_batches": 2}
    pl.seed_everything(0, verbose=False)
    model = module_class(pl)(split.x_train[0].numel(), split.n_classes, lr=0.1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks,
                         max_steps=settings["steps"], accumulate_grad_batches=settings["accumulate"],
                         val_check_interval=validation.pop("val_check_interval", None),
                         limit_val_batches=validation.pop("limit_val_batches", None), num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, deterministic=True)
    trainer.fit(model, DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=32, shuffle=False),
                **validation)
    return {"strategy": type(trainer.strategy).__name__, "state_dict": model.state_dict(),
            "losses": model.losses, "validated": model.validated,
            "hook_bytes": callbacks[0].state.bytes if callbacks else 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--package", choices=["lightning", "pytorch_lightning"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("fits", nargs="+", type=parse_fit, metavar="FIT")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    from paraloom.integrations.lightning import for_package

    bridge = for_package(args.package)
    pl = importlib.import_module(bridge.package)
    split = load_dataset("digits")
    results = [fit(pl, bridge, name, settings, split) for name, settings in args.fits]
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / "results.pt")


if __name__ == "__main__":
    main()
