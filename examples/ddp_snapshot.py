"""An ordinary torch DDP script in the shape of PyTorch's DDP tutorial (`multigpu_torchrun.py`): a
Trainer snapshots the model every few epochs and, started again by torchrun, resumes from the snapshot.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/ddp_snapshot.py 12 1

To train it with paraloom, change one line: the DDP import below becomes
`from paraloom import DataParallel as DDP`. The tests kill a worker of each under torchrun and
compare the resumed run with an uninterrupted one.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model: nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.rank}] Resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epochs_run: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(), "EPOCHS_RUN": epochs_run}
        torch.save(snapshot, self.snapshot_path + ".tmp")  # whole or not at all, should rank 0 die here
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)
        print(f"Epoch {epochs_run - 1} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def load_train_objs() -> tuple[Dataset, nn.Module, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 20, generator=generator)
    train_set = TensorDataset(x, (x[:, :5].sum(1) > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt") -> None:
    torch.set_num_threads(1)
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if trainer.rank == 0:
        torch.save(trainer.model.module.state_dict(), "model.pt")
        print(f"trained {total_epochs} epochs", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each rank")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
