"""Model profile: per-layer FLOPs and bytes measured on the meta device (a 175B GPT in seconds, no memory)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_leaves

from paraloom.config.choices import FULLY_SHARDED
from paraloom.config.errors import UserError
from paraloom.perfmodel.from_config import Predictable
from paraloom.perfmodel.measure.autocast import Autocast
from paraloom.perfmodel.measure.op_counter import FusedAttention, Live, OpCounter, nbytes
from paraloom.perfmodel.measure.specs import build_from_spec
from paraloom.perfmodel.model_profile import (
    KERNELS,
    PROFILE_BATCHES,
    RECOMPUTE,
    LayerProfile,
    ModelProfile,
    check_choice,
)
from paraloom.pipeline_parallel.partition import model_pieces, piece_names

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _signature(layer: nn.Module, x: torch.Tensor) -> tuple | None:
    """What fixes a layer's costs: structure, plain attributes, tensor shapes, input; None if unhashable."""
    simple = (bool, int, float, str, tuple)
    attrs = tuple((type(m).__qualname__, tuple(sorted((k, v) for k, v in vars(m).items()
                                                      if not k.startswith("_") and isinstance(v, simple))))
                  for m in layer.modules())
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in [*layer.named_parameters(), *layer.named_buffers()])
    key = (type(layer), repr(layer), attrs, tensors, tuple(x.shape), x.dtype, x.requires_grad)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _measure(layer: nn.Module, x: torch.Tensor, shared: set[int], low: torch.dtype | None = None,
             loss: bool = False) -> tuple[dict, torch.Tensor]:
    """Run one layer forward and backward on meta; its counts, and its output detached for the next layer.

    `low`: under autocast to that dtype (the layer's weights fp32). `loss`: the layer ends the model,
    and its forward and backward include the training loss on its output (see `_loss`)."""
    x = x.detach().requires_grad_(x.requires_grad)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in shared:  # parameters and buffers are not activations
            saved[storage._cdata] = storage.nbytes()
        return t

    for p in layer.parameters():
        p.grad = None  # a gradient left from another run would add an accumulation
    live = Live(shared | {x.untyped_storage()._cdata})  # the input is the layer before's
    fwd = OpCounter(live)
    casts = Autocast(low) if low is not None else contextlib.nullcontext()
    recomputing = _recomputing_under(FusedAttention, casts)  # from the forward's checkpoint calls on
    saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with recomputing, FusedAttention(), casts, fwd, saving:
        out = layer(x)
        scalar = _loss(out) if loss else None
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    # what forward leaves for backward: saved tensors, and what a checkpoint keeps to recompute from
    passed_on = [*outs, *([scalar] if scalar is not None else [])]
    held = live.alive({t.untyped_storage()._cdata for t in passed_on})
    grad_outs = [t for t in outs if t.requires_grad] if scalar is None else [scalar]
    grads = [torch.empty_like(t) for t in grad_outs]
    live.add(grads)  # the gradient the layer after hands back
    bwd = OpCounter(live)
    if grad_outs:
        with bwd, _recomputing_under(FusedAttention, casts):  # hold the patch through backward too
            torch.autograd.backward(grad_outs, grads)
    live.close()
    in_key = x.untyped_storage()._cdata
    out_keys = {t.untyped_storage()._cdata for t in outs}
    counts = {"fwd_flops": fwd.flops, "bwd_flops": bwd.flops,
              "fwd_mem_bytes": fwd.mem, "bwd_mem_bytes": bwd.mem,
              "activation_bytes": sum(saved.values()), "output_bytes": sum(nbytes(t) for t in outs),
              "input_saved_bytes": saved.get(in_key, 0),
              "output_saved_bytes": sum(saved.get(k, 0) for k in out_keys if k != in_key),
              "fwd_kernels": fwd.kernels, "bwd_kernels": bwd.kernels, "fwd_ops": fwd.ops, "bwd_ops": bwd.ops,
              "fwd_winograd": fwd.winograd, "bwd_winograd": bwd.winograd,
              "fwd_winograd5": fwd.winograd5, "bwd_winograd5": bwd.winograd5,
              "work_bytes": max(0, live.peak - sum(saved.values())), "held_bytes": held}
    single = out if isinstance(out, torch.Tensor) else None
    return counts, single.detach().requires_grad_(single.requires_grad) if single is not None else out


@contextlib.contextmanager
def _recomputing_under(fused: type, casts: contextlib.AbstractContextManager):
    """While it lasts, `torch.utils.checkpoint.checkpoint` recomputes under the profile's function
    modes (fused attention, emulated autocast), as the forward ran: a mode would not reach into the
    backward, whose recomputation must save what the forward saved."""
    original = torch.utils.checkpoint.checkpoint

    @contextlib.contextmanager
    def modes():
        with fused(), Autocast(casts.low) if isinstance(casts, Autocast) else contextlib.nullcontext():
            yield

    def checkpoint(function, *args, **kwargs):
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), modes())
        return original(function, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = checkpoint
    try:
        yield
    finally:
        torch.utils.checkpoint.checkpoint = original


def _loss(out: object) -> torch.Tensor | None:
    """The loss paraloom trains a model's output with (train/loss_eval.py): cross-entropy over the last
    dimension, summed; None for an output that is not a floating tensor of scores (a model's own loss)."""
    scores = isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() >= 2
    if not scores or not out.requires_grad:
        return None
    flat = out.reshape(-1, out.shape[-1])
    target = torch.empty(flat.shape[0], dtype=torch.long, device=out.device)
    return F.cross_entropy(flat, target, reduction="sum")


def _run_chain(pieces: list[tuple[str, nn.Module]], x: torch.Tensor, shared: set[int],
               low: torch.dtype | None = None) -> list[dict]:
    cache: dict[tuple, tuple[dict, tuple]] = {}
    results = []
    for index, (name, layer) in enumerate(pieces):
        last = index == len(pieces) - 1
        if not isinstance(x, torch.Tensor):
            raise UserError(f"piece {name!r} gets a {type(x).__name__}, not a tensor; the profile follows "
                            "one tensor from piece to piece: wrap pieces that pass several in one module")
        key = _signature(layer, x)
        key = None if key is None else (*key, last)
        if key is not None and key in cache:
            counts, (shape, dtype, grad) = cache[key]
            x = torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)
        else:
            counts, x = _measure(layer, x, shared, low, loss=last)
            if key is not None and isinstance(x, torch.Tensor):
                cache[key] = counts, (tuple(x.shape), x.dtype, x.requires_grad)
        results.append(counts)
    return results


def _slope(a: object, b: object, db: int) -> object:
    if isinstance(a, dict):
        return {k: _slope(a[k], b[k], db) for k in a}
    return max(0.0, (b - a) / db)


def _pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers profiled one by one: an nn.Sequential's children, the pieces a model lists for
    pipelines (`pipeline_pieces()`), else the model as one piece."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if callable(getattr(model, "pipeline_pieces", None)):
        pieces = model_pieces(model)
        return list(zip(piece_names(model, pieces), pieces, strict=True))
    return [(type(model).__name__, model)]


@functools.lru_cache(maxsize=16)
def _profile(spec: str, dtype: str, data: str | None = None, selective: bool = False,
             half_model: bool = False) -> ModelProfile:
    model, make_input = build_from_spec(spec, "meta", data)
    model.train()  # fp32 weights: a mixed-precision profile runs under emulated autocast, as training does
    half_model = half_model and dtype != "fp32"
    if half_model:  # or the model itself in the low dtype, its floating inputs too (no autocast)
        model.to(DTYPES[dtype])
        make_input = _cast_input(make_input, DTYPES[dtype])
    if selective:  # the model runs it, so the counters see its recomputation and what it keeps
        cores = [m for m in model.modules() if hasattr(m, "selective")]
        if not cores:
            raise UserError(f"recompute=selective recomputes a transformer's attention core; {spec!r} "
                            "has none")
        for module in cores:
            module.selective = True
    low = DTYPES[dtype] if dtype != "fp32" and not half_model else None
    named = _pieces(model)
    shared = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    runs, input_sizes = [], []
    for batch in PROFILE_BATCHES:
        x = make_input(batch)
        input_sizes.append(nbytes(x))
        try:
            runs.append(_run_chain(named, x, shared, low))
        except (RuntimeError, NotImplementedError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"model spec {spec!r} cannot run on the meta device ({first}); profiling "
                            "runs shapes only: the model must not read values (.item())") from exc
    db = PROFILE_BATCHES[1] - PROFILE_BATCHES[0]
    seen: set[int] = set()
    layers = []
    for (name, layer), small, large in zip(named, *runs, strict=True):
        params = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        per_sample = {k: _slope(small[k], large[k], db) for k in small if k not in KERNELS}
        layers.append(LayerProfile(name=name, param_count=sum(p.numel() for p in params),
                                   param_tensors=len(params), **per_sample,
                                   **{k: large[k] for k in KERNELS}))
    return ModelProfile(spec=spec, dtype=dtype, recompute="none", layers=tuple(layers),
                        input_bytes=(input_sizes[1] - input_sizes[0]) / db, half_model=half_model)


def _cast_input(make_input, dtype: torch.dtype):
    def make(batch: int):
        x = make_input(batch)
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return make


def profile_model(spec: str, *, dtype: str = "fp32", recompute: str = "none",
                  data: str | None = None, half_model: bool = False) -> ModelProfile:
    """Profile the model a spec names (see `specs.SPEC_HELP`) in `dtype`, with recompute "none",
    "selective" (the attention core, as the model runs it: measured) or "full" (every layer, priced
    from the profile); a user's model may take its example input from the data set `data` names
    (`package.module:factory`). `half_model`: the model itself in fp16/bf16, as Megatron-LM and
    DeepSpeed train (their memory layouts), instead of paraloom's fp32 weights under autocast."""
    check_choice(dtype, DTYPES, "dtype")
    check_choice(recompute, RECOMPUTE, "recompute")
    spec = spec.strip() if isinstance(spec, str) else spec
    base = _profile(spec, dtype, data.strip() if data else None, recompute == "selective", half_model)
    return replace(base, recompute=recompute)


@functools.lru_cache(maxsize=16)
def shard_unit_sizes(spec: str, units: str = "auto", data: str | None = None) -> tuple[int, ...]:
    """Parameters of each unit `parallel.shard_units=units` shards the model `spec` names in, as
    `fully_shard` holds them (a unit inside another takes its own parameters from the outer one's),
    in module order, the root's leftovers last: built on the meta device, so any size is cheap."""
    from paraloom.data_parallel.fully_sharded import find_units

    model, _ = build_from_spec(spec.strip(), "meta", data.strip() if data else None)
    found = find_units(model, units)
    claimed: set[int] = set()
    sizes = []
    for _, module in reversed(found):  # inner units come after their outer ones in module order
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    root = sum(p.numel() for p in model.parameters() if id(p) not in claimed)
    return (*reversed(sizes), root)


def with_units(what: Predictable) -> Predictable:
    """`what` (from_config.predictable) with, for a fully sharded plan, the sizes of the units its run
    cuts the model in (`Options.shard_units`, priced by cost/sharding.py)."""
    if what.plan.shard not in FULLY_SHARDED:
        return what
    units = shard_unit_sizes(what.spec, what.shard_units, what.data)
    return replace(what, options=replace(what.options, shard_units=units))


__all__ = ["DTYPES", "profile_model", "shard_unit_sizes", "with_units"]
