"""What the strategies train with: the batch loss, evaluation, accumulation chunks, step counts."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.data import DataSets, collate


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, scale: float,
               loss: str = "classification", smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, summed loss of this shard's samples).

    The back-propagated loss is the shard's summed loss times `scale`, dp_world_size / global_count
    (0 for a rank's padding sample when its slice of a short batch is empty, see
    data/sampler.py), so that averaging gradients over the data-parallel group gives exactly the
    gradient of the global batch's mean loss. A sample with several targets (a sequence's tokens)
    counts by its mean loss per target; a model that returns its loss (`loss="model"`) is taken to
    return the mean over its batch. `smoothing`: cross-entropy's label smoothing.
    """
    if loss == "model":
        if smoothing:
            raise UserError("label smoothing applies to paraloom's cross-entropy, not the model's own loss")
        loss_sum = model(x, y) * len(x)
    else:
        out = model(x)
        per_sample = y[0].numel() if y.dim() > 1 else 1
        flat = out.reshape(-1, out.shape[-1])
        summed = F.cross_entropy(flat, y.reshape(-1), reduction="sum", label_smoothing=smoothing)
        loss_sum = summed / per_sample
    reported = loss_sum.detach() if scale else torch.zeros_like(loss_sum.detach())
    return loss_sum * scale, reported


def eval_batches(data: DataSets, group: dist.ProcessGroup | None, device: torch.device, batch: int = 1024):
    """(x, y) batches of this rank's slice of the evaluation set (all of it without `group`)."""
    n = len(data.eval)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    mine = torch.arange(n).tensor_split(world)[rank]
    loader = DataLoader(data.eval, batch_sampler=[c.tolist() for c in mine.split(batch)], collate_fn=collate)
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def score(out: torch.Tensor | None, y: torch.Tensor, loss: str, *, model_loss=None) -> torch.Tensor:
    """[summed loss per target, correct predictions, targets] of one evaluation batch (float64)."""
    if loss == "model":
        return torch.tensor([float(model_loss) * len(y), 0.0, float(len(y))], dtype=torch.float64)
    flat = out.reshape(-1, out.shape[-1]).float()
    return torch.stack([F.cross_entropy(flat, y.reshape(-1), reduction="sum").double(),
                        (flat.argmax(dim=-1) == y.reshape(-1)).sum().double(),
                        torch.tensor(float(y.numel()), dtype=torch.float64, device=out.device)]).cpu()


@torch.no_grad()
def evaluate(model: nn.Module, data: DataSets, group: dist.ProcessGroup | None, device: torch.device, *,
             forward=None, sum_group: dist.ProcessGroup | None = None, counts: bool = True,
             batch: int = 1024, lockstep: bool = False) -> dict[str, float | None]:
    """{"test_accuracy", "val_loss"} on the evaluation set: each rank of `group` scores a slice and
    the sums are added over `sum_group` (default `group`; neither: this rank alone, on all of it,
    without communication). `forward(x)` gives a batch's logits (default `model(x)`; None where
    this rank has none); `counts=False`: this rank's sums are not added (a pipeline's other stages).
    A model that returns its own loss has no accuracy (None). `lockstep`: every rank of `group` (None:
    the world) scores its slice and makes as many forwards as the rank with most batches, its extra
    ones on one sample, not scored: a fully sharded model's forward gathers its units from every
    rank, so the ranks must call it alike (with tensor parallelism `group` is the data-parallel one:
    a replica's tp ranks score the same slice)."""
    model.eval()
    group = (group if group is not None else dist.group.WORLD) if lockstep else group
    sums = torch.zeros(3, dtype=torch.float64)
    forwards = 0
    for xb, yb in eval_batches(data, group, device, batch=batch):
        forwards += 1
        if data.loss == "model":
            sums += score(None, yb, data.loss, model_loss=model(xb, yb))
        elif (out := (forward or model)(xb)) is not None:
            sums += score(out, yb, data.loss)
    if lockstep:
        largest = -(-len(data.eval) // dist.get_world_size(group))  # tensor_split's first slices: largest
        most = -(-largest // batch)
        x0, y0 = collate([data.eval[0]])
        x0, y0 = x0.to(device), y0.to(device)
        for _ in range(most - forwards):
            model(x0, y0) if data.loss == "model" else (forward or model)(x0)
    sums *= counts
    if (sum_group or group) is not None:
        dist.all_reduce(sums, group=sum_group or group)
    model.train()
    return results_of(sums, data.loss)


def results_of(sums: torch.Tensor, loss: str) -> dict[str, float | None]:
    """Summary fields of evaluation sums [loss, correct, targets]."""
    targets = max(float(sums[2]), 1.0)
    return {"test_accuracy": None if loss == "model" else float(sums[1]) / targets,
            "val_loss": float(sums[0]) / targets}


def chunks(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A shard cut into `k` accumulation micro-batches (fewer when it has fewer samples: none empty)."""
    n = max(1, min(k, len(x)))
    return list(zip(x.tensor_split(n), y.tensor_split(n), strict=True))


def steps_per_epoch(cfg: Config, dataset_size: int, *, drop_last: bool = False) -> int:
    """Optimizer steps in one pass over `dataset_size` samples (the short last batch dropped or not)."""
    batch = cfg.data.batch_size
    return dataset_size // batch if drop_last else -(-dataset_size // batch)


def planned_steps(cfg: Config, dataset_size: int, *, drop_last: bool = False) -> int:
    """Optimizer steps of the whole run for a training set of `dataset_size` samples."""
    steps = cfg.optim.epochs * steps_per_epoch(cfg, dataset_size, drop_last=drop_last)
    return min(steps, cfg.optim.max_steps) if cfg.optim.max_steps is not None else steps
