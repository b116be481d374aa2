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
- `"sequence"`: left whole, but runs on each rank's share of the sequence (Korthikanti et al. 2022:
  layer norms, dropout): its parameters' gradients are summed over the tp group.
- `{"style": "colwise", "fused": k, "heads": "n_heads"}`: the weight stacks k projections (q, k, v)
  along out_features, laid out (k, n_heads, head_dim); each rank keeps its heads of every one.
  `heads` names an int attribute of the layer's parent holding the head count: tp must divide it,
  and it is divided by tp afterwards, so the attention computes its local heads. Without `heads`,
  each of the k stacked blocks is split evenly (for attention that derives its head count from
  its local width).
- `{"style": ..., "input": layout, "output": layout}`: how a split layer's input arrives and how its
  output leaves (torch's input_layouts / output_layouts), among `layouts.LAYOUTS`; `LAYER_LAYOUTS` lists
  which each layer takes, its default first. `"sequence"` is the sequence dimension `sequence_dim` (1
  unless the entry says).
- `{"style": "prepare", "input": ..., "desired_input": ..., "output": ..., "desired_output": ...}`: a
  module left as it is whose positional inputs (outputs) arrive in the first layouts and are handed on
  in the desired ones (torch's PrepareModuleInput / PrepareModuleOutput): a layout or a list of them,
  null leaving one alone.

Every rank of the tp group first takes the group's first rank's parameters and buffers (one broadcast
per dtype; `sync_weights=False` skips it), as `parallelize_module` distributes rank 0's tensors.
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

from paraloom.comm.collectives import broadcast_coalesced
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
from paraloom.tensor_parallel.layouts import LAYOUTS, GradAllReduce, LayoutHooks, hooks_of
from paraloom.tensor_parallel.mappings import group_rank, group_size

STYLES = ("colwise", "rowwise", "vocab", "replicate", "sequence", "prepare")
LAYOUT_KEYS = ("input", "output", "desired_input", "desired_output", "sequence_dim")
KEYS = ("style", "fused", "heads", *LAYOUT_KEYS)
TYPES = {"colwise": nn.Linear, "rowwise": nn.Linear, "vocab": nn.Embedding}
# a split layer's layouts: (the inputs it takes, the outputs it gives), its default first in each
LAYER_LAYOUTS = {
    "colwise": (("replicate", "sequence"), ("shard", "replicate")),
    "rowwise": (("shard", "replicate"), ("replicate", "sequence")),
    "vocab": (("replicate",), ("replicate", "sequence")),
}
Plan = Mapping[str, Any]  # pattern -> style name or {"style": ..., <KEYS>}


@dataclass(frozen=True)
class Style:
    """One plan entry, parsed: how a matched module is split and how its activations are laid out."""

    style: str
    fused: int = 1  # projections stacked along out_features (colwise only)
    heads: str | None = None  # the parent's attribute holding the head count (colwise only)
    # layouts of the positional inputs as they arrive and of the outputs as they leave (one for a
    # split layer); a prepare entry's desired ones are those its module is handed / hands on
    input: tuple[str | None, ...] = ()
    output: tuple[str | None, ...] = ()
    desired_input: tuple[str | None, ...] = ()
    desired_output: tuple[str | None, ...] = ()
    sequence_dim: int = 1  # the dimension a "sequence" layout shards


@dataclass
class _Target:
    """A module the plan matched, where it hangs, and the entry that matched it."""

    name: str
    pattern: str
    style: Style
    module: nn.Module
    parent: nn.Module | None  # None: the root module itself
    attr: str


def _layouts(where: str, key: str, value: Any, *, nulls: bool) -> tuple[str | None, ...]:
    """A layout, or (with `nulls`) a list of layouts and nulls, as a tuple."""
    items = list(value) if nulls and isinstance(value, (list, tuple)) else [value]
    if not items or not all(item in LAYOUTS or (nulls and item is None) for item in items):
        listed = " or a list of them (null: left alone)" if nulls else ""
        raise UserError(f"{where}: {key}={value!r} is not a layout; give one of {', '.join(LAYOUTS)}{listed}")
    return tuple(items)


def _layer_layouts(where: str, style: str, value: Mapping) -> dict[str, tuple[str | None, ...]]:
    """A split layer's input and output layouts, its defaults where the entry gives none."""
    given = [key for key in ("desired_input", "desired_output") if key in value]
    if given:
        raise UserError(f"{where}: {given[0]} belongs to a prepare entry; a {style} layer takes input and "
                        "output (the layouts its input arrives and its output leaves in)")
    out = {}
    for key, allowed in zip(("input", "output"), LAYER_LAYOUTS[style], strict=True):
        layout = _layouts(where, key, value.get(key, allowed[0]), nulls=False)
        if layout[0] not in allowed:
            raise UserError(f"{where}: a {style} layer's {key} is {' or '.join(allowed)}, not {layout[0]!r}")
        out[key] = layout
    return out


def _prepared_layouts(where: str, value: Mapping) -> dict[str, tuple[str | None, ...]]:
    """A prepare entry's pairs (input, desired_input) and (output, desired_output), at least one."""
    out: dict[str, tuple[str | None, ...]] = {}
    for key in ("input", "output"):
        wanted = f"desired_{key}"
        if (key in value) != (wanted in value):
            missing = wanted if key in value else key
            raise UserError(f"{where}: give {key} and {wanted} together (the layouts it arrives in and is "
                            f"handed on in); {missing} is missing")
        if key not in value:
            continue
        have = _layouts(where, key, value[key], nulls=True)
        want = _layouts(where, wanted, value[wanted], nulls=True)
        nulls_differ = any((a is None) != (b is None) for a, b in zip(have, want, strict=False))
        if len(have) != len(want) or nulls_differ:
            raise UserError(f"{where}: {key}={list(have)} and {wanted}={list(want)} must list the same "
                            f"{key}s, null at the same places")
        out[key], out[wanted] = have, want
    if not out:
        raise UserError(f"{where}: a prepare entry needs input and desired_input, or output and "
                        "desired_output")
    return out


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
    if style in LAYER_LAYOUTS:
        layouts = _layer_layouts(where, style, value)
    elif style == "prepare":
        layouts = _prepared_layouts(where, value)
    else:
        given = [key for key in LAYOUT_KEYS if key in value]
        if given:
            raise UserError(f"{where}: {given[0]} does not apply to a {style} module, which takes its input "
                            "as it arrives; lay out the activations around it with the layers' input and "
                            "output or a prepare entry")
        layouts = {}
    sequence_dim = value.get("sequence_dim", 1)
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise UserError(f"{where}: sequence_dim={sequence_dim!r} must be an integer (the dimension a "
                        "sequence layout shards)")
    if "sequence_dim" in value and not any("sequence" in layout for layout in layouts.values()):
        raise UserError(f"{where}: sequence_dim={sequence_dim} applies to a sequence layout, and this entry "
                        "has none")
    return Style(style, fused, heads, sequence_dim=sequence_dim, **layouts)


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


def _check_hooked(t: _Target, targets: list[_Target], shared: set[int]) -> None:
    """A sequence or prepare module: not given its hooks already; a sequence one holds no split layer
    and shares no parameter (its gradients are summed over the group: a shared one's would be too)."""
    label = f"module {t.name or '(root)'!r}"
    if hooks_of(t.module):
        raise UserError(f"{label} has tensor-parallel hooks already: apply the tp plan once")
    if t.style.style != "sequence":
        return
    prefix = t.name + "." if t.name else ""
    inside = [u for u in targets if u.style.style in TYPES and u.name.startswith(prefix) and u is not t]
    if inside:
        raise UserError(f"{label} is sequence-parallel (whole, on a share of the sequence) but holds "
                        f"{inside[0].name!r} ({inside[0].style.style}); mark its norms and dropouts "
                        "sequence, not the module around them")
    if any(id(p) in shared for p in t.module.parameters()):
        raise UserError(f"a parameter of {label} is shared with another module; a sequence-parallel module "
                        "sums its own gradients over the tp group: untie them")


def _check_type(t: _Target, shared: set[int]) -> None:
    """The matched module is the kind its style splits, not split already, and owns its weight."""
    kind = TYPES.get(t.style.style)
    if kind is None:  # replicate, sequence, prepare: any module
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
        if t.style.style in ("sequence", "prepare"):
            _check_hooked(t, targets, shared)
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
    style, dim = t.style, t.style.sequence_dim
    (given,), (gives,) = style.input, style.output
    if style.style == "rowwise":
        return RowParallelLinear.from_linear(t.module, group, input_is_parallel=given == "shard",
                                             sequence_parallel=gives == "sequence", sequence_dim=dim)
    if style.style == "vocab":
        return VocabParallelEmbedding.from_embedding(t.module, group, sequence_parallel=gives == "sequence",
                                                     sequence_dim=dim)
    rows = _fused_rows(t.module.out_features, style.fused, tp, rank) if style.fused > 1 else None
    return ColumnParallelLinear.from_linear(t.module, group, rows=rows, gather_output=gives == "replicate",
                                            sequence_parallel=given == "sequence", sequence_dim=dim)


def _hook(t: _Target, group: dist.ProcessGroup | None) -> None:
    """Give a sequence module its gradient all-reduce, a prepare module its layout hooks."""
    style = t.style
    if style.style == "sequence":
        GradAllReduce(group).attach(t.module)
        return
    pairs = {key: tuple(None if a is None else (a, b) for a, b in zip(have, want, strict=True))
             for key, have, want in (("inputs", style.input, style.desired_input),
                                     ("outputs", style.output, style.desired_output))}
    LayoutHooks(t.name or "(root)", group, sequence_dim=style.sequence_dim, **pairs).attach(t.module)


@torch.no_grad()
def sync_weights_from_first(module: nn.Module, tp_group: dist.ProcessGroup | None = None) -> None:
    """Every rank of `tp_group` takes the group's first rank's parameters and buffers: one broadcast per
    dtype and device (tensors on the meta device hold no values and are left alone)."""
    if group_size(tp_group) == 1:
        return
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    broadcast_coalesced([t for t in tensors if not t.is_meta], tp_group)


def plan_for(configured: Any, model: nn.Module, tp: int) -> Any:
    """The tensor-parallel plan a run splits `model` by: the config's `model.tp_plan` (`configured`), or
    the model's own `tp_plan`; neither is refused in one line."""
    plan = configured or getattr(model, "tp_plan", None)
    if not plan:
        raise UserError(f"parallel.tp={tp} needs a tensor-parallel plan: set model.tp_plan "
                        "(pattern -> colwise/rowwise/vocab/replicate/sequence/prepare) or give the model one")
    return plan


def apply_tp_plan(module: nn.Module, plan: Plan, tp_group: dist.ProcessGroup | None = None, *,
                  strict: bool = True, sync_weights: bool = True) -> nn.Module:
    """Rewrite in place every module `plan` matches to hold this rank's shard over `tp_group`.

    With `sync_weights` every rank first takes the tp group's first rank's full parameters and buffers
    (one broadcast per dtype), so ranks that built the model differently (no seed) still split one model;
    without it every rank must start from the same full weights. With `strict` every pattern must match
    a module; a pipeline stage (a slice of the model) passes `strict=False`. Everything is checked
    before anything changes. Returns `module` (the new layer when the plan matches the root module itself).
    """
    tp, rank = group_size(tp_group), group_rank(tp_group)
    targets = _resolve(module, plan, strict)
    _check(module, targets, tp)
    if tp == 1:
        return module
    if sync_weights:
        sync_weights_from_first(module, tp_group)
    divided: set[tuple[int, str]] = set()
    for t in targets:
        if t.style.style == "replicate":
            continue
        if t.style.style in ("sequence", "prepare"):
            _hook(t, tp_group)
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
