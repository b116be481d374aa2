"""apply_tp_plan: split any module over a tensor-parallel group by a plan of module-name patterns -> styles.

The shape of torch DTensor's `parallelize_module` plans, executed with paraloom's Megatron layers.
A plan maps patterns over `module.named_modules()` names (dot-separated; each atom matched with
`fnmatch`, so `*` matches exactly one atom: `"*.attn.qkv"`, `"blocks.*.mlp.fc"`) to a style:

- `"colwise"`: an nn.Linear becomes a ColumnParallelLinear (out_features split); its output stays
  sharded on the last dimension and is marked so (`is_tp_sharded`), like ColwiseParallel with
  use_local_output.
- `"rowwise"`: an nn.Linear becomes a RowParallelLinear (input sharded on the last dimension,
  output all-reduced, bias added once).
- `"vocab"`: an nn.Embedding becomes a VocabParallelEmbedding (vocabulary split in ranges).
- `"replicate"`: left whole; declares that its gradients come out equal on every tp rank.
- `{"style": "colwise", "fused": k, "heads": "n_heads"}`: the weight stacks k projections (q, k, v)
  along out_features, laid out (k, n_heads, head_dim); each rank keeps its heads of every one.
  `heads` names an int attribute of the layer's parent holding the head count: tp must divide it,
  and it is divided by tp afterwards, so the attention computes its local heads. Without `heads`,
  each of the k stacked blocks is split evenly (for attention that derives its head count from
  its local width).

Every size check runs before any module changes; `check_tp_plan` runs them alone, without a process
group and without reading data (a model on the meta device will do), so a bad plan is refused
before any worker starts. A model's output logits must be returned as its colwise output layer gives
them (no view or copy after it) for `is_tp_sharded` to see them as vocabulary-sharded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.config.errors import UserError
from paraloom.tensor_parallel.layers import (
    PARALLEL_LAYERS,
    SHARDED_MARK,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_divides,
    check_plain_embedding,
    tp_choices,
)
from paraloom.tensor_parallel.mappings import group_rank, group_size

STYLES = ("colwise", "rowwise", "vocab", "replicate")
KEYS = ("style", "fused", "heads")
TYPES = {"colwise": nn.Linear, "rowwise": nn.Linear, "vocab": nn.Embedding}
Plan = Mapping[str, Any]  # pattern -> style name or {"style": ..., "fused": k, "heads": "<attr>"}


@dataclass(frozen=True)
class Style:
    """One plan entry, parsed: how a matched module is split."""

    style: str
    fused: int = 1  # projections stacked along out_features (colwise only)
    heads: str | None = None  # the parent's attribute holding the head count (colwise only)


@dataclass
class _Target:
    """A module the plan matched, where it hangs, and the entry that matched it."""

    name: str
    pattern: str
    style: Style
    module: nn.Module
    parent: nn.Module | None  # None: the root module itself
    attr: str


def parse_style(pattern: str, value: Any) -> Style:
    """Plan entry `pattern: value` as a Style, or a one-line UserError saying what is wrong."""
    where = f"tp_plan entry {pattern!r}"
    if isinstance(value, str):
        value = {"style": value}
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: give a style name ({', '.join(STYLES)}) or a mapping with keys "
                        f"{', '.join(KEYS)}, not {type(value).__name__}")
    unknown = [str(key) for key in value if key not in KEYS]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    style, fused, heads = value.get("style"), value.get("fused", 1), value.get("heads")
    if style not in STYLES:
        raise UserError(f"{where}: unknown style {style!r}; choose one of {', '.join(STYLES)}")
    if isinstance(fused, bool) or not isinstance(fused, int) or fused < 1:
        raise UserError(f"{where}: fused={fused!r} must be a positive integer (projections stacked)")
    if heads is not None and (not isinstance(heads, str) or not heads.isidentifier()):
        raise UserError(f"{where}: heads={heads!r} must name an attribute of the layer's parent module")
    if style != "colwise" and (fused != 1 or heads is not None):
        raise UserError(f"{where}: fused and heads describe a colwise layer's output; drop them from "
                        f"this {style} entry")
    return Style(style, fused, heads)


def matches(pattern: str, name: str) -> bool:
    """Whether module name `name` matches `pattern`, atom by atom (`*` is one atom, never a dot)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True))


def _some_names(module: nn.Module, n: int = 8) -> str:
    """A few module names to help a user fix a pattern: splittable layers first."""
    names = [name for name, m in module.named_modules() if name and isinstance(m, (nn.Linear, nn.Embedding))]
    names = names or [name for name, _ in module.named_modules() if name] or ["(none)"]
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _resolve(module: nn.Module, plan: Plan, strict: bool) -> list[_Target]:
    """Every (module, entry) pair the plan matches, in module order; refuses conflicts and misses."""
    if not isinstance(plan, Mapping):
        raise UserError(f"a tp_plan maps module-name patterns to styles, not {type(plan).__name__}")
    styles = {str(pattern): parse_style(str(pattern), value) for pattern, value in plan.items()}
    named = list(module.named_modules())
    targets: list[_Target] = []
    for name, m in named:
        hits = [(pattern, style) for pattern, style in styles.items() if matches(pattern, name)]
        if len({style for _, style in hits}) > 1:
            (p1, s1), (p2, s2) = hits[0], next(h for h in hits if h[1] != hits[0][1])
            raise UserError(f"module {name!r} matches tp_plan entries {p1!r} ({s1.style}) and {p2!r} "
                            f"({s2.style}); make the patterns say one thing for it")
        if hits:
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if name else None
            targets.append(_Target(name, hits[0][0], hits[0][1], m, parent, attr))
    if strict:
        for pattern in styles:
            if not any(matches(pattern, name) for name, _ in named):
                raise UserError(f"tp_plan pattern {pattern!r} matches no module of the model; "
                                f"its modules include: {_some_names(module)}")
    return targets


def _check_type(t: _Target, shared: set[int]) -> None:
    """The matched module is the kind its style splits, not split already, and owns its weight."""
    kind = TYPES.get(t.style.style)
    if kind is None:  # replicate: anything goes
        return
    label = f"module {t.name or '(root)'!r}"
    if isinstance(t.module, PARALLEL_LAYERS):
        raise UserError(f"{label} is a {type(t.module).__name__} already: apply the tp plan once")
    if not isinstance(t.module, kind):
        found = type(t.module).__name__
        raise UserError(f"tp_plan entry {t.pattern!r} ({t.style.style}) needs an nn.{kind.__name__}, "
                        f"but {label} is {'an' if found[0] in 'AEIOU' else 'a'} {found}")
    if t.style.heads is not None and t.parent is None:
        raise UserError(f"tp_plan entry {t.pattern!r}: heads={t.style.heads!r} needs a parent module, "
                        "and the root module has none")
    if isinstance(t.module, nn.Embedding):
        check_plain_embedding(t.module, label)
    if id(t.module.weight) in shared:
        raise UserError(f"the weight of {label} is shared with another module (tied weights); "
                        "a tensor-parallel plan splits each weight on its own: untie them")


def _head_count(t: _Target) -> int:
    value = getattr(t.parent, t.style.heads, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        parent = t.name.rpartition(".")[0] or "(root)"
        raise UserError(f"tp_plan entry {t.pattern!r}: heads={t.style.heads!r} must name a positive int "
                        f"attribute of module {parent!r} (the parent of {t.name!r}), found {value!r}")
    return value


def _split_sizes(t: _Target) -> list[tuple[int, str, int]]:
    """(order, size name, size) of every size tp must divide for this target; head counts order first."""
    m, style, where = t.module, t.style, f"module {t.name or '(root)'!r}"
    if style.style == "rowwise":
        return [(1, "in_features", m.in_features)]
    if style.style == "vocab":
        return [(2, "vocab_size", m.num_embeddings)]
    if style.style != "colwise":
        return []
    k, out = style.fused, m.out_features
    if out % k:
        raise UserError(f"{where}: fused={k} does not divide out_features={out}; "
                        f"the weight must stack {k} equal projections")
    block = out // k
    if style.heads is None:
        return [(1, "out_features" if k == 1 else f"out_features/{k}", block)]
    heads = _head_count(t)
    if block % heads:
        raise UserError(f"{where}: {style.heads}={heads} does not divide each projection's "
                        f"{block} output features into whole heads")
    return [(0, style.heads, heads)]


def _check(module: nn.Module, targets: list[_Target], tp: int) -> None:
    """Types, then divisibility of every split size (the most telling named first)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UserError(f"tp={tp!r} must be a positive integer")
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    shared = {key for key, n in uses.items() if n > 1}
    for t in targets:
        _check_type(t, shared)
    sizes = [(order, t.name or "(root)", name, size)
             for t in targets for order, name, size in _split_sizes(t)]
    choices = tp_choices(*(size for *_, size in sizes))
    for _, where, name, size in sorted(sizes, key=lambda s: s[0]):  # stable: module order within a kind
        check_divides(tp, name, size, choices, where=f"module {where!r}")


def check_tp_plan(module: nn.Module, plan: Plan, tp: int, *, strict: bool = True) -> None:
    """Refuse, with a one-line UserError, a plan `apply_tp_plan` would refuse at `tp` ranks: patterns
    that match nothing (with `strict`), modules of the wrong type, sizes tp does not divide.
    Needs no process group, changes nothing and reads no data (the model may be on the meta device)."""
    _check(module, _resolve(module, plan, strict), tp)


def _fused_rows(out: int, fused: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's rows of `fused` stacked projections: its share of each, in projection order."""
    block = out // fused
    width = block // tp
    own = torch.arange(rank * width, (rank + 1) * width)
    return torch.cat([part * block + own for part in range(fused)])


def _split(t: _Target, group: dist.ProcessGroup | None, tp: int, rank: int) -> nn.Module:
    if t.style.style == "rowwise":
        return RowParallelLinear.from_linear(t.module, group)
    if t.style.style == "vocab":
        return VocabParallelEmbedding.from_embedding(t.module, group)
    rows = _fused_rows(t.module.out_features, t.style.fused, tp, rank) if t.style.fused > 1 else None
    return ColumnParallelLinear.from_linear(t.module, group, rows=rows)


def apply_tp_plan(module: nn.Module, plan: Plan, tp_group: dist.ProcessGroup | None = None, *,
                  strict: bool = True) -> nn.Module:
    """Rewrite in place every module `plan` matches to hold this rank's shard over `tp_group`.

    Every rank of `tp_group` must start from the same full weights (build the model with the same
    seed). With `strict` every pattern must match a module; a pipeline stage (a slice of the model)
    passes `strict=False`. Everything is checked before anything changes. Returns `module` (the
    new layer when the plan matches the root module itself).
    """
    tp, rank = group_size(tp_group), group_rank(tp_group)
    targets = _resolve(module, plan, strict)
    _check(module, targets, tp)
    if tp == 1:
        return module
    divided: set[tuple[int, str]] = set()
    for t in targets:
        if t.style.style == "replicate":
            continue
        layer = _split(t, tp_group, tp, rank)
        if t.parent is None:
            module = layer
        else:
            setattr(t.parent, t.attr, layer)
        if t.style.heads is not None and (id(t.parent), t.style.heads) not in divided:
            divided.add((id(t.parent), t.style.heads))  # several layers may name one head count
            setattr(t.parent, t.style.heads, getattr(t.parent, t.style.heads) // tp)
    return module


def is_tp_sharded(tensor: Any) -> bool:
    """Whether `tensor` is a column-parallel layer's output, sharded on its last dimension (so a model's
    logits are vocabulary-sharded and want `vocab_parallel_cross_entropy`). A view or copy of it is not."""
    return isinstance(tensor, torch.Tensor) and getattr(tensor, SHARDED_MARK, False) is True
