"""What the strategies train with: model, engine, batch loss, evaluation, step count (optimizer: optim/)."""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from paraloom.comm.collectives import CommStats
from paraloom.config import CommConfig, Config, OptimConfig
from paraloom.data import DataSets, collate
from paraloom.data_parallel import DataParallel, DataParallelNaive
from paraloom.errors import UserError
from paraloom.models import MODELS, build_model
from paraloom.models.user import load_user_model
from paraloom.rules import is_factory
from paraloom.topology import RankGroups


def make_model(cfg: Config, data: DataSets) -> nn.Module:
    """The model `model.*` names: a user's factory, or a zoo model shaped for `data`."""
    name, options = cfg.model.name, cfg.model.options
    if is_factory(name):
        return load_user_model(name, options)
    if data.n_classes is None:
        raise UserError(f"model.name={name} needs the number of classes; give the data set's DataSets "
                        "n_classes=")
    fields = dataclasses.asdict(cfg.model)
    for key in ("name", "options", "tp_plan"):
        fields.pop(key)
    if name in MODELS:  # the zoo's constructors take (and ignore) any keyword: refuse a typo
        params = inspect.signature(MODELS[name]).parameters.values()
        takes = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise UserError(f"model.options {', '.join(unknown)}: model.name={name} does not take "
                            f"{'it' if len(unknown) == 1 else 'them'}; it takes: {', '.join(takes)}")
    return build_model(name, input_shape(data), data.n_classes, **{**fields, **options})  # options win


def input_shape(data: DataSets) -> tuple[int, ...]:
    """The shape of one training input (its first sample's)."""
    return tuple(torch.as_tensor(data.train[0][0]).shape)


def make_engine(model: nn.Module, comm: CommConfig, groups: RankGroups, stats: CommStats, timeline=None,
                optim: OptimConfig | None = None,
                comm_group: dist.ProcessGroup | None = None) -> DataParallel | DataParallelNaive:
    """The data-parallel engine `comm.*` asks for, over `groups`' data-parallel group."""
    if comm.engine == "naive":
        return DataParallelNaive(model, group=groups.dp_group, algorithm=comm.algorithm, stats=stats)
    options = dgc_options(comm, optim) if optim is not None else None
    return DataParallel(model, topology=groups, comm=comm, stats=stats, timeline=timeline,
                        compressor_options=options, comm_group=comm_group)


def dgc_options(comm: CommConfig, optim: OptimConfig) -> dict[str, float] | None:
    """DGC's momentum correction replaces the optimizer's momentum (Lin et al. 2018): with SGD the
    compressor takes optim.momentum and the optimizer runs without it; Adam keeps its own moments,
    so DGC runs without momentum correction (sampled top-k with error feedback)."""
    if comm.compressor != "dgc":
        return None
    return {"momentum": optim.momentum if optim.name == "sgd" else 0.0}


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, scale: float,
               loss: str = "classification") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, summed loss of this shard's samples).

    The back-propagated loss is the shard's summed loss times `scale`, dp_world_size / global_count
    (0 for a rank's padding sample when its slice of a short batch is empty, see
    data/sampler.py), so that averaging gradients over the data-parallel group gives exactly the
    gradient of the global batch's mean loss. A sample with several targets (a sequence's tokens)
    counts by its mean loss per target; a model that returns its loss (`loss="model"`) is taken to
    return the mean over its batch.
    """
    if loss == "model":
        loss_sum = model(x, y) * len(x)
    else:
        out = model(x)
        per_sample = y[0].numel() if y.dim() > 1 else 1
        flat = out.reshape(-1, out.shape[-1])
        loss_sum = F.cross_entropy(flat, y.reshape(-1), reduction="sum") / per_sample
    reported = loss_sum.detach() if scale else torch.zeros_like(loss_sum.detach())
    return loss_sum * scale, reported


def eval_batches(data: DataSets, group: dist.ProcessGroup | None, device: torch.device,
                 batch: int = 1024, workers: int = 0):
    """(x, y) batches of this rank's slice of the evaluation set (all of it without `group`)."""
    n = len(data.eval)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    mine = torch.arange(n).tensor_split(world)[rank]
    loader = DataLoader(data.eval, batch_sampler=[c.tolist() for c in mine.split(batch)],
                        collate_fn=collate, num_workers=workers)
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
def evaluate(model: nn.Module, data: DataSets, group: dist.ProcessGroup | None, device: torch.device,
             workers: int = 0) -> dict[str, float | None]:
    """{"test_accuracy", "val_loss"} on the evaluation set: each rank of `group` scores a slice and
    the sums are added (without `group`: this rank alone, on all of it, without communication).
    A model that returns its own loss has no accuracy (None)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for xb, yb in eval_batches(data, group, device, workers=workers):
        if data.loss == "model":
            sums += score(None, yb, data.loss, model_loss=model(xb, yb))
        else:
            sums += score(model(xb), yb, data.loss)
    if group is not None:
        dist.all_reduce(sums, group=group)
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
