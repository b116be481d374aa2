"""A model-parallel checkpoint onto another grid: the whole model and optimizer state rebuilt from the saved
ranks' pieces, then cut again for this rank's stage and tensor-parallel slice.

Each rank saves, beside its stage's state, its `layout`: its place in the grid, its stage's first
piece, the tensor-parallel split of each of its sharded tensors (dimension and the unsplit
indices it holds) and its parameters' keys in the optimizer's order. A run on another grid reads
the parts of one replica (dp rank 0: replicas are identical), keys every tensor by its piece
number in the whole model, joins the tp slices, and hands each rank what its own stage and slice
hold. Optimizer state tensors shaped as their parameter are split alike; the rest (step counts,
hyper-parameters) is every rank's same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paraloom.config.errors import UserError
from paraloom.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def layout(model: nn.Module, *, first_piece: int, coords: dict[str, int]) -> dict[str, Any]:
    """What a re-split needs of this rank's stage (saved in its checkpoint part)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, PARALLEL_LAYERS)}
    split = {}
    for key in model.state_dict():
        prefix, _, leaf = key.rpartition(".")
        layer = layers.get(prefix)
        if layer is not None and leaf in layer.sharded:
            split[key] = [layer.sharded[leaf], layer.full_index.clone()]
    return {"coords": dict(coords), "first_piece": first_piece, "split": split,
            "param_keys": [name for name, _ in model.named_parameters()]}


def _whole_key(key: str, first_piece: int) -> str:
    head, _, rest = key.partition(".")
    return f"{int(head) + first_piece}.{rest}"


def _join(values: list[tuple[torch.Tensor, list | None]]) -> torch.Tensor:
    """One tensor from its tp slices (value, [dim, full_index]); an unsplit one as it is."""
    if values[0][1] is None:
        return values[0][0]
    dim = values[0][1][0]
    shards = torch.cat([v for v, _ in values], dim=dim)
    index = torch.cat([split[1] for _, split in values]).to(shards.device)
    return torch.empty_like(shards).index_copy_(dim, index, shards)


def whole_state(parts: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(model state, optimizer state per parameter) of the whole model, keyed "<piece>.<rest>", from the
    parts of one replica's ranks."""
    replica = sorted((p for p in parts if p["layout"]["coords"]["dp"] == 0),
                     key=lambda p: p["layout"]["coords"]["tp"])
    model: dict[str, list] = {}
    optim: dict[str, dict[str, list]] = {}
    for part in replica:
        lay = part["layout"]
        split = lay["split"]
        for key, value in part["model"].items():
            model.setdefault(_whole_key(key, lay["first_piece"]), []).append((value, split.get(key)))
        states = part["optimizer"]["state"]
        for i, key in enumerate(lay["param_keys"]):
            for name, value in states.get(i, {}).items():
                sliced = torch.is_tensor(value) and value.dim() > 0
                optim.setdefault(_whole_key(key, lay["first_piece"]), {}).setdefault(name, []).append(
                    (value, split.get(key) if sliced else None))
    return ({key: _join(values) for key, values in model.items()},
            {key: {name: _join(values) for name, values in named.items()} for key, named in optim.items()})


def _own(modules: dict[str, nn.Module], key: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's tp slice of the whole `value` of its stage's `key` (`modules`: the stage's, by name)."""
    prefix, _, leaf = key.rpartition(".")
    layer = modules.get(prefix)
    if isinstance(layer, PARALLEL_LAYERS) and leaf in layer.sharded and value.dim() > 0:
        return value.index_select(layer.sharded[leaf], layer.full_index.to(value.device))
    return value


def stage_states(model: nn.Module, optimizer_state: dict[str, Any], whole: dict[str, torch.Tensor],
                 whole_optim: dict[str, dict[str, Any]], *, first_piece: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state dict, optimizer state dict) of this rank's stage and slice; `optimizer_state`: a
    saved rank's, for its hyper-parameters."""
    modules = dict(model.named_modules())
    state = {key: _own(modules, key, whole[_whole_key(key, first_piece)]) for key in model.state_dict()}
    keys = [name for name, _ in model.named_parameters()]
    per_param = {i: {name: _own(modules, key, value) for name, value in
                     whole_optim.get(_whole_key(key, first_piece), {}).items()} for i, key in enumerate(keys)}
    groups = [{**optimizer_state["param_groups"][0], "params": list(range(len(keys)))}]
    return state, {"state": {i: s for i, s in per_param.items() if s}, "param_groups": groups}


def load_whole(model: nn.Module, optimizer: torch.optim.Optimizer, parts: list[dict[str, Any]]) -> None:
    """Load a model-parallel checkpoint's parts into a whole `model` and its `optimizer` (one group)."""
    from paraloom.pipeline_parallel.partition import model_pieces, piece_names

    if len(optimizer.param_groups) != 1:
        raise UserError("a model-parallel checkpoint resumes under data parallelism with an optimizer of one "
                        "parameter group; with optim.no_decay, resume it on the grid it saved with")
    whole, whole_optim = whole_state(parts)
    names = piece_names(model, model_pieces(model, whole=True))  # as the run that saved them cut it
    user = {_user_key(key, names): key for key in whole}
    model.load_state_dict({name: whole[key] for name, key in user.items()})
    keys = [name for name, _ in model.named_parameters()]
    groups = [{**parts[0]["optimizer"]["param_groups"][0], "params": list(range(len(keys)))}]
    states = {i: whole_optim[user[name]] for i, name in enumerate(keys) if user[name] in whole_optim}
    optimizer.load_state_dict({"state": states, "param_groups": groups})


def _user_key(key: str, names: list[str]) -> str:
    """"<piece>.<rest>" as the model names it ("3.weight" -> "blocks.1.weight")."""
    index, _, rest = key.partition(".")
    prefix = names[int(index)]
    return f"{prefix}.{rest}" if prefix else rest
