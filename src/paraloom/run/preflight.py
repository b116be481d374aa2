"""Before any worker starts: the model, data set and recipe a config names, built once and checked.

A user's factories are imported and called here, in the launching process, so that a factory that
does not import, raises, takes other options or returns the wrong thing is one line and exit 2
rather than a traceback on every rank. The data sets are built (a batch larger than the training
set, a text corpus shorter than one sample) and the model on the meta device (shapes, no memory:
its parameters, gradients and optimizer state against this machine's memory); where a user's code
or model options are in play, one real batch goes through it (run/batch_check.py). A tensor-parallel
plan is checked against the model, a pipeline against its pieces, the optimizer's name and options
against torch.optim, injected faults against the run's steps, and the checkpoint a resume starts from.
The training stack is imported only by the checks that need it: a default job's launcher imports
torch earlier than it did to launch, and reads digits and builds the CNN on meta in some 40 ms.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.config.fault_specs import check_faults, parse_faults
from paraloom.config.rules import is_factory
from paraloom.data import DataSets, load_data
from paraloom.models.make import make_model
from paraloom.optim import check_optimizer
from paraloom.optim.optimizers import accepted_arguments

STATE_FACTOR = 4  # bytes held per parameter byte: itself, its gradient and Adam's two moments


def preflight(cfg: Config, world: int, *, resume: Path | None = None) -> DataSets:
    """Check what `cfg` trains on `world` workers (after `cfg.validate_world`), resuming from `resume`
    (a run directory) if given; the data sets built."""
    optimizer = check_optimizer(cfg.optim.name, cfg.optim.options)
    if cfg.optim.no_decay and "weight_decay" not in (accepted_arguments(optimizer) or ["weight_decay"]):
        raise UserError(f"optim.no_decay exempts parameters from weight decay; optim.name={cfg.optim.name} "
                        "takes no weight_decay")
    data = load_data(cfg)  # a text corpus too short for one sample of data.seq_len is refused here
    check_batch_size(cfg, data)
    if cfg.optim.label_smoothing and data.loss == "model":
        raise UserError(f"optim.label_smoothing={cfg.optim.label_smoothing} smooths paraloom's "
                        f"cross-entropy; data.name={cfg.data.name}'s model returns its own loss "
                        "(loss='model'): smooth it there")
    with torch.device("meta"):
        model = make_model(cfg, data)  # optim.no_decay's patterns checked against its names here
    check_memory(cfg, model, world)
    if is_factory(cfg.model.name) or is_factory(cfg.data.name) or cfg.model.options:
        from paraloom.run.batch_check import check_batch  # the zoo on its own data needs no batch

        check_batch(cfg, data, model, on_gpus=_on_gpus(cfg))
    if cfg.parallel.model_parallel:
        check_model_parallel(cfg, model, world)
    if cfg.run.inject is not None:
        check_injected_faults(cfg, len(data.train), world)
    if resume is not None:
        check_checkpoint(resume)
    return data


def check_batch_size(cfg: Config, data: DataSets) -> None:
    """A global batch no larger than the training set (a larger one trained on the whole set each
    step without a word, or where short batches are dropped, on none)."""
    n = len(data.train)
    if cfg.data.batch_size > n:
        raise UserError(f"data.batch_size={cfg.data.batch_size} exceeds the {n} samples of data.name="
                        f"{cfg.data.name}'s training set: choose at most {n}")


def check_memory(cfg: Config, model: torch.nn.Module, world: int) -> None:
    """A model that fits this machine: each replica's parameters, gradients and optimizer state
    (`STATE_FACTOR` times the parameters' bytes, a pipeline's or tensor-parallel group's ranks
    sharing one) on the workers that train on its CPU, against the memory available."""
    if _on_gpus(cfg):
        return  # the GPUs hold it; asking CUDA here would hold a context in the launcher
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    replica = sum(p.numel() * p.element_size() for p in params) * STATE_FACTOR
    replicas = cfg.grid(world)[0]  # the parameter server's workers each hold one too
    need, free = replica * replicas, available_memory()
    if need > free:
        dtype = params[0].dtype if params else torch.float32
        fewer = ", or fewer replicas: fewer workers (--nproc) or workers sharing one (parallel.tp, " \
            "parallel.pp)" if replicas > 1 and replica <= free else ""
        raise UserError(f"model.name={cfg.model.name} has {count:,} parameters ({dtype}): about "
                        f"{_gib(replica)} per replica with its gradients and optimizer state "
                        f"({STATE_FACTOR} x its bytes), {_gib(need)} for {replicas} replica(s), but this "
                        f"machine has {_gib(free)} available: use a smaller model{fewer}")


def available_memory() -> int:
    """Bytes of memory available to new processes: the kernel's estimate (Linux's MemAvailable, as
    psutil reads it: importing psutil took 25-90 ms of the launcher's start), else psutil's, else
    all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.virtual_memory().available)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _on_gpus(cfg: Config) -> bool:
    """Whether the workers train on GPUs (`run.device`; auto: where torch sees one)."""
    return cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())


def check_model_parallel(cfg: Config, model: torch.nn.Module, world: int) -> None:
    """The pieces a pipeline places and the plan tensor parallelism splits by, at this grid."""
    from paraloom.pipeline_parallel.partition import model_pieces
    from paraloom.tensor_parallel import check_tp_plan

    _, tp, pp = cfg.grid(world)
    if pp > 1 or cfg.parallel.mode == "layers":
        pieces = model_pieces(model)
        if pp > len(pieces):
            raise UserError(f"parallel.pp={pp} stages exceed model.name={cfg.model.name}'s {len(pieces)} "
                            "pieces; lower parallel.pp or use a deeper model")
    if tp > 1:
        plan = tp_plan_of(cfg, model)
        check_tp_plan(model, plan, tp)


def tp_plan_of(cfg: Config, model: torch.nn.Module):
    """`model.tp_plan` from the config, else the model's own `tp_plan` attribute."""
    plan = cfg.model.tp_plan or getattr(model, "tp_plan", None)
    if not plan:
        raise UserError(f"parallel.tp={cfg.parallel.tp} needs a tensor-parallel plan: set model.tp_plan "
                        "(module-name pattern -> colwise/rowwise/vocab/replicate/sequence/prepare) or give "
                        "the model a tp_plan attribute")
    return plan


def check_injected_faults(cfg: Config, n_train: int, world: int) -> None:
    """`run.inject`'s faults against the ranks and the steps the run will take."""
    from paraloom.train.loss_eval import planned_steps
    from paraloom.train.strategies import STRATEGIES

    steps = planned_steps(cfg, n_train, drop_last=STRATEGIES[cfg.strategy].drop_last)
    check_faults(parse_faults(cfg.run.inject), world, steps)


def check_checkpoint(run_dir: Path) -> None:
    """The newest whole checkpoint a resume of `run_dir` starts from: its manifest read as the
    workers will read it (a damaged or edited field is one line here, not a failure in every rank)."""
    from paraloom.train.checkpoint.store import latest_valid, manifest_of

    path = latest_valid(run_dir, quiet=True)  # the workers' resume warns of a damaged one, once
    if path is not None:
        manifest_of(path)
