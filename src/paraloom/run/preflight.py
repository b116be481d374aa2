"""Before any worker starts: the model, data set and recipe a config names, built once and checked.

A user's factories are imported and called here, in the launching process, so that a factory that
does not import, raises, takes other options or returns the wrong thing is one line and exit 2
rather than a traceback on every rank. The model is built on the meta device (shapes, no memory);
a tensor-parallel plan is checked against it, a pipeline against its pieces, the optimizer's name
and options against torch.optim, injected faults against the run's steps.
"""

from __future__ import annotations

import torch

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.config.fault_specs import check_faults, parse_faults
from paraloom.config.rules import is_factory
from paraloom.data import DataSets, load_data
from paraloom.models.make import make_model
from paraloom.optim import check_optimizer
from paraloom.optim.optimizers import accepted_arguments
from paraloom.pipeline_parallel.partition import model_pieces
from paraloom.tensor_parallel import check_tp_plan
from paraloom.train.loss_eval import planned_steps
from paraloom.train.strategies import STRATEGIES


def preflight(cfg: Config, world: int) -> DataSets | None:
    """Check what `cfg` trains on `world` workers (after `cfg.validate_world`); the data sets built,
    or None where nothing needs them: a zoo model on a built-in data set, no model options, no
    model parallelism and no faults are checked by the config alone (loading digits here would
    add seconds to every run's start)."""
    optimizer = check_optimizer(cfg.optim.name, cfg.optim.options)
    if cfg.optim.no_decay and "weight_decay" not in (accepted_arguments(optimizer) or ["weight_decay"]):
        raise UserError(f"optim.no_decay exempts parameters from weight decay; optim.name={cfg.optim.name} "
                        "takes no weight_decay")
    if not (is_factory(cfg.model.name) or is_factory(cfg.data.name) or cfg.model.options
            or cfg.parallel.model_parallel or cfg.run.inject is not None or cfg.optim.no_decay):
        return None
    data = load_data(cfg)
    if cfg.optim.label_smoothing and data.loss == "model":
        raise UserError(f"optim.label_smoothing={cfg.optim.label_smoothing} smooths paraloom's "
                        f"cross-entropy; data.name={cfg.data.name}'s model returns its own loss "
                        "(loss='model'): smooth it there")
    with torch.device("meta"):
        model = make_model(cfg, data)  # optim.no_decay's patterns checked against its names here
    if cfg.parallel.model_parallel:
        check_model_parallel(cfg, model, world)
    if cfg.run.inject is not None:
        steps = planned_steps(cfg, len(data.train), drop_last=STRATEGIES[cfg.strategy].drop_last)
        check_faults(parse_faults(cfg.run.inject), world, steps)
    return data


def check_model_parallel(cfg: Config, model: torch.nn.Module, world: int) -> None:
    """The pieces a pipeline places and the plan tensor parallelism splits by, at this grid."""
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
                        "(module-name pattern -> colwise/rowwise/vocab/replicate) or give the model a "
                        "tp_plan attribute")
    return plan
