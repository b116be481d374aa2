"""A checkpoint's state split in two: its tensors by name (for torch.distributed.checkpoint) and a skeleton.

DCP stores tensors well and reshards them at load, but it keeps every other object as a pickle that
its reader loads with `weights_only=False`. So only tensors go to DCP: `split` walks the nested
dicts, lists and tuples of a state and puts each tensor under a name made of its path
("shared/model/fc.weight", "rank1/engine/residual/0"), leaving in its place a small record of
name, shape and dtype. The skeleton that remains (numbers, 0-d tensors such as Adam's step count,
strings, dtypes, the records) is saved with `torch.save` and read with `weights_only=True`.
`targets` makes the empty tensors DCP loads into, and `join` puts them back in the skeleton's
places. A DTensor is recorded with its global shape, to be loaded into a DTensor of the loading
world's own layout (`make_sharded`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

TENSOR = "__tensor__"


def split(state: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors by name) of `state`; names start with `prefix`, a DTensor's with "sharded"
    instead: every rank holding a block of it names it alike."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.dim() == 0:
            return obj.detach().clone()  # a number (Adam's step count): kept in the skeleton
        if isinstance(obj, torch.Tensor):
            sharded = isinstance(obj, DTensor)
            name = ("sharded" if sharded else prefix) + path
            if name in tensors:
                raise ValueError(f"two entries of the state are both named {name!r}")
            tensors[name] = obj if sharded else _own_storage(obj.detach())
            return {TENSOR: name, "shape": list(obj.shape), "dtype": obj.dtype, "sharded": sharded}
        if isinstance(obj, dict):
            return {key: walk(value, f"{path}/{key}") for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(value, f"{path}/{i}") for i, value in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    return walk(state, ""), tensors


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A view into a larger buffer (flat parameter buckets) would be saved with the whole buffer."""
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes
    return tensor if whole else tensor.contiguous().clone()


def records(skeleton: Any) -> list[dict[str, Any]]:
    """The tensor records of a skeleton, in order."""
    found: list[dict[str, Any]] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            if TENSOR in obj:
                found.append(obj)
                return
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(skeleton)
    return found


def targets(skeleton: Any, device: torch.device,
            make_sharded: Callable[[str, list[int], torch.dtype], torch.Tensor] | None = None,
            ) -> dict[str, torch.Tensor]:
    """Empty tensors, by name, for DCP to load a skeleton's tensors into."""
    out: dict[str, torch.Tensor] = {}
    for record in records(skeleton):
        name, shape, dtype = record[TENSOR], record["shape"], record["dtype"]
        if record["sharded"]:
            if make_sharded is None:
                raise ValueError(f"{name} was saved sharded; the loader gave no layout to load it into")
            out[name] = make_sharded(name, shape, dtype)
        else:
            out[name] = torch.empty(shape, dtype=dtype, device=device)
    return out


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state again: every record of `skeleton` replaced by its loaded tensor."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton:
            return tensors[skeleton[TENSOR]]
        return {key: join(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, list):
        return [join(value, tensors) for value in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join(value, tensors) for value in skeleton)
    return skeleton
