"""A Lightning script on paraloom's engine: 2 CPU processes, started by Lightning itself.

    python examples/lightning_paraloom.py

With the legacy package (`import pytorch_lightning as pl`), take its classes by name:
`from paraloom.integrations.lightning import for_package` and
`ParaloomStrategy = for_package("pytorch_lightning").ParaloomStrategy`, or give `strategy="paraloom"`.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.data import load_dataset
from paraloom.integrations.lightning import ParaloomStrategy


class Classifier(pl.LightningModule):
    def __init__(self, n_in: int, n_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(n_in, 64), nn.ReLU(), nn.Linear(64, n_classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3)


if __name__ == "__main__":
    torch.set_num_threads(1)
    pl.seed_everything(0)
    split = load_dataset("digits")
    model = Classifier(split.x_train[0].numel(), split.n_classes)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=4, logger=False, enable_checkpointing=False,
                         strategy=ParaloomStrategy(scheduler="priority", compressor="powersgd"))
    trainer.fit(model, DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=32, shuffle=True))
    if trainer.global_rank == 0:
        with torch.no_grad():
            accuracy = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
        print(f"test accuracy {accuracy:.3f}")
