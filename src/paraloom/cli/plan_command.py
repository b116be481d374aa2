"""`paraloom plan`: rank the plans for a model on a cluster, recommend a node count, emit a config."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from paraloom.config.choices import FULLY_SHARDED, MODELLED_ALGORITHMS, STRATEGY_ENTRIES
from paraloom.config.errors import UserError
from paraloom.config.rules import strategy_for
from paraloom.config.yaml_io import merge
from paraloom.models import MODELS
from paraloom.perfmodel.cost.mfu import model_flops_per_sample, peak_flops
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import Hardware, load_hardware, parse_bytes
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.measure.specs import parse_args
from paraloom.perfmodel.plan import Estimate, Options, Plan
from paraloom.perfmodel.planner import Ranked, is_exact, parse_nodes, parse_plan, rank, recommend

GPT_KEYS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads"}


class _Utilisation:
    """A plan's model FLOPs utilisation (perfmodel/cost/mfu.py): the model's FLOPs a sample times the
    plan's samples/s, over its devices' peak in the run's precision."""

    def __init__(self, profile, hw: Hardware, dtype: str) -> None:
        self.per_sample, self.hw, self.dtype = model_flops_per_sample(profile), hw, dtype

    def __call__(self, e: Estimate) -> float:
        return self.per_sample * e.samples_per_s / peak_flops(self.hw, self.dtype, e.plan.devices)

    def plan_dict(self, e: Estimate) -> dict[str, Any]:
        return {**e.to_dict(), "mfu": self(e)}


def _row(table: Table, e: Estimate, nodes: int, eff: float | None, mfu: _Utilisation) -> None:
    table.add_row(e.plan.label(), f"{e.step_s * 1e3:,.1f}", f"{e.samples_per_s:,.1f}",
                  "-" if eff is None else f"{eff:.2f}", f"{mfu(e):.1%}", f"{e.memory_bytes / 2**30:,.2f}",
                  e.bottleneck, "" if is_exact(e.plan) else "no", str(nodes))


def _table(title: str) -> Table:
    table = Table(title=title)
    for name in ("plan", "step ms", "samples/s", "efficiency", "MFU", "GiB/device", "bottleneck", "exact",
                 "nodes"):
        table.add_column(name, justify="left" if name in ("plan", "bottleneck") else "right")
    return table


def _scaling_table(results: list[Ranked], eff: list[float], model: str, hardware: str, batch: int,
                   mfu: _Utilisation) -> Table:
    """One row a node count: its best plan, the efficiency `recommend` gave it (against the smallest
    count's throughput per node), or that no plan fits there."""
    base = next(r.nodes for r in results if r.estimates)
    table = _table(f"{model} on {hardware}, global batch {batch}: the best plan at each node count "
                   f"(efficiency: samples/s per node, against the same at {base} node(s))")
    for r, e in zip(results, eff, strict=True):
        if r.estimates:
            _row(table, r.best, r.nodes, e, mfu)
        else:
            table.add_row(f"none of {r.dropped} fits", "-", "-", "-", "-", "-", "memory", "", str(r.nodes))
    return table


def run_plan(*, model: str, cluster: str, nodes: str, global_batch: int, dtype: str = "fp32",
             recompute: str = "none", optimizer: str = "adam", plan: str | None = None,
             json_out: Path | None = None, emit: Path | None = None, plot: Path | None = None,
             floor: float = 0.7, exact_only: bool = False, top: int = 10,
             data: str | None = None, layout: str = "ddp", sample_bytes: str | float = 0,
             base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predict one plan (`plan`) or rank every plan at each node count; print, and write what was asked
    (`base`: the config the model came from, as written, which --emit lays the plan over)."""
    _check_arguments((json_out, emit, plot), global_batch, floor, layout, emit is not None)
    options = Options(optimizer=optimizer, layout=layout,
                      sample_bytes=parse_bytes(sample_bytes, "--sample-bytes"))
    hw = load_hardware(cluster)
    profile = profile_model(model, dtype=dtype, recompute=recompute, data=data, half_model=layout != "ddp")
    counts = parse_nodes(nodes)
    mfu = _Utilisation(profile, hw, dtype)
    console = Console(width=max(Console().width, 130))
    if plan is not None:
        given = parse_plan(plan)
        n = counts[0]
        if given.devices > n * hw.devices_per_node:
            raise UserError(f"plan {given.label()!r} needs {given.devices} devices; {n} node(s) of "
                            f"{hw.name} have {n * hw.devices_per_node}")
        e = estimate(profile, hw, given, global_batch, options)
        one = estimate(profile, hw, Plan(), global_batch, options)  # one device, fitting or not
        efficiency = e.samples_per_s / (given.devices * one.samples_per_s)
        table = _table(f"{model} on {n} x {hw.name}, global batch {global_batch}: predicted "
                       f"(efficiency against one device)")
        _row(table, e, n, efficiency, mfu)
        console.print(table)
        console.print({k: f"{v * 1e3:.2f} ms" for k, v in e.breakdown.items()})
        report = {"model": model, "hardware": hw.to_dict(), "global_batch": global_batch,
                  "nodes": n, "estimate": mfu.plan_dict(e), "efficiency_vs_one_device": efficiency,
                  "one_device": one.to_dict()}
    else:
        results: list[Ranked] = []
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("planning", total=len(counts))
            for n in counts:
                results.append(rank(profile, hw, n, global_batch, options=options, exact_only=exact_only))
                progress.advance(task)
        best, eff = recommend(results, floor)
        if len(counts) > 1:  # the curve first: each node count's best plan
            console.print(_scaling_table(results, eff, model, hw.name, global_batch, mfu))
        for r, e in zip(results, eff, strict=True):
            table = _table(f"{model} on {r.nodes} x {hw.name} ({r.nodes * hw.devices_per_node} devices), "
                           f"global batch {global_batch}: {len(r.estimates)} plans fit, {r.dropped} do not")
            for est in r.estimates[:top]:
                _row(table, est, r.nodes, e if est is r.best else None, mfu)
            if len(counts) == 1 or r is best:
                console.print(table)
        top_plan = best.best
        console.print(f"recommended: {best.nodes} node(s), {top_plan.plan.label()}: "
                      f"{top_plan.samples_per_s:,.1f} samples/s predicted "
                      f"(scaling efficiency >= {floor:.2f} up to {best.nodes} nodes)")
        if best.estimates[0] is not top_plan:
            fast = best.estimates[0]
            console.print(f"faster but changing the math: {fast.plan.label()} "
                          f"({fast.samples_per_s / top_plan.samples_per_s:.2f}x)")
        report = {"model": model, "hardware": hw.to_dict(), "global_batch": global_batch,
                  "efficiency_floor": floor,
                  "recommended": {"nodes": best.nodes, "plan": mfu.plan_dict(top_plan)},
                  "by_nodes": [{"nodes": r.nodes, "efficiency": e, "dropped": r.dropped,
                                "plans": [mfu.plan_dict(x) for x in r.estimates]}
                               for r, e in zip(results, eff, strict=True)]}
        if plot is not None:
            from paraloom.cli.plan_plots import plot_scaling

            plot_scaling(results, plot, title=f"{model} on {hw.name}")
            console.print(f"plot: {plot}")
        e = top_plan
    report["profile"] = profile_summary(profile, global_batch)
    if emit is not None:
        emit_nodes = report["recommended"]["nodes"] if "recommended" in report else report["nodes"]
        emit.write_text(emit_config(model, hw, e, global_batch, emit_nodes, dtype=dtype, data=data,
                                    base=base, recompute=recompute))
        console.print(f"config: {emit} (run it with `paraloom train {emit}`)")
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _check_arguments(paths: tuple[Path | None, ...], global_batch: int, floor: float, layout: str,
                     emitting: bool) -> None:
    for path in paths:
        if path is not None and not path.parent.is_dir():
            raise UserError(f"{str(path)!r}: directory {str(path.parent)!r} does not exist")
    if global_batch < 1:
        raise UserError(f"--global-batch {global_batch} must be at least 1")
    if not 0 < floor <= 1:
        raise UserError(f"--efficiency-floor {floor} must lie in (0, 1]")
    if layout != "ddp" and emitting:
        raise UserError(f"--emit: paraloom trains in the ddp layout; --layout {layout} prices another "
                        "framework's run")


def profile_summary(profile, global_batch: int) -> dict[str, Any]:
    """What the model is, for the JSON: parameters, and FLOPs per step by phase and in all."""
    flops = {phase: sum(profile.flops_by_class(phase).values()) * global_batch
             for phase in ("fwd", "bwd", "recompute")}
    return {"spec": profile.spec, "dtype": profile.dtype, "recompute": profile.recompute,
            "parameters": profile.n_params, "layers": len(profile.layers),
            "flops_per_step": sum(flops.values()),
            "forward_flops_per_step": flops["fwd"], "backward_flops_per_step": flops["bwd"],
            "recompute_flops_per_step": flops["recompute"]}


def emit_config(model: str, hw: Hardware, e: Estimate, global_batch: int, nodes: int, *,
                dtype: str = "fp32", data: str | None = None, base: dict[str, Any] | None = None,
                recompute: str = "none") -> str:
    """A config `paraloom train` runs as it is: the model (zoo arguments, or a user's factory and
    options with the data set `data` names), the precision it was predicted at, the plan's choices.
    With `base` (a config as its user wrote it, `paraloom plan CONFIG`): that config, its model, data
    and recipe kept, with the plan's sections laid over it and the batch planned for. A zoo GPT
    predicted with `recompute` (not none) recomputes so in the config too: the plan fits only so."""
    notes: list[str] = []
    written = _written(base or {})
    if base is not None:
        config = merge(copy.deepcopy(base), {"data": {"batch_size": global_batch}})
    elif model.strip().partition(":")[0] in MODELS:
        model_cfg, data_cfg = _zoo_sections(model, global_batch, notes)
        if recompute != "none" and model_cfg["name"] == "gpt":
            model_cfg["recompute"] = recompute
        config = {"model": model_cfg, "data": data_cfg}
    else:
        model_cfg, data_cfg = _user_sections(model, data, global_batch)
        config = {"model": model_cfg, "data": data_cfg}
    sections = _plan_sections(e.plan, nodes, dtype)
    config = merge(config, sections)
    strategy = strategy_for(mode=config["parallel"]["mode"], tp=e.plan.tp, pp=e.plan.pp, shard=e.plan.shard)
    unused = STRATEGY_ENTRIES[strategy].unused_at(e.plan.pp)
    for key in sorted(written & _written(sections) - set(unused)):
        section, _, name = key.partition(".")
        if base[section][name] != sections[section][name]:
            notes.append(f"{key}={base[section][name]} replaced by the plan's {sections[section][name]}")
    for key in unused:  # what the plan's strategy does not use is left out
        section, _, name = key.partition(".")
        if config.get(section, {}).pop(name, None) is not None and key in written:
            notes.append(f"{key} left out: {e.plan.label()} has no use for it")
    head = [f"# paraloom plan: {e.plan.label()} on {nodes} x {hw.name}",
            f"# predicted {e.step_s * 1e3:.1f} ms/step, {e.samples_per_s:,.1f} samples/s, "
            f"{e.memory_bytes / 2**30:.2f} GiB/device, bottleneck {e.bottleneck}",
            f"# {nodes} node(s): `paraloom train THIS.yaml` on one, or torchrun --nnodes {nodes} "
            f"--nproc-per-node {config['parallel']['nproc']} -m paraloom.run.worker THIS.yaml on each"]
    head += [f"# note: {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(config, sort_keys=False)


def _written(config: dict[str, Any]) -> set[str]:
    """The `section.key` names a config sets."""
    return {f"{section}.{key}" for section, values in config.items() if isinstance(values, dict)
            for key in values}


def _plan_sections(p: Plan, nodes: int, dtype: str) -> dict[str, Any]:
    """The sections of a train config that choose plan `p` on `nodes` nodes, at precision `dtype`."""
    if p.ps_node_sum:
        raise UserError("--emit: ps_node_sum prices TensorFlow's distributed_replicated parameter servers; "
                        "paraloom's workers each push their own gradients")
    if p.sequence_parallel:
        raise UserError("--emit: sequence parallelism is priced for other systems' runs (Megatron-LM); "
                        "paraloom's tensor parallelism does not split the sequence")
    if p.algorithm in MODELLED_ALGORITHMS:
        raise UserError(f"--emit: algorithm={p.algorithm} is another system's all-reduce, which the model "
                        "prices but paraloom does not run; emit a plan with native, ring, halving_doubling, "
                        "tree or one_to_all")
    workers = p.dp * p.tp * p.pp
    sections: dict[str, Any] = {
        "run": {"precision": dtype},  # an emitted plan trains at the precision it was predicted for
        "parallel": {"mode": "ps" if p.servers else "dp", "nproc": max(1, workers // nodes), "tp": p.tp,
                     "pp": p.pp, "microbatches": p.microbatches, "schedule": p.schedule,
                     **({"virtual_stages": p.virtual_stages} if p.virtual_stages > 1 else {}),
                     **({"shard": p.shard} if p.shard != "none" else {}),
                     **({"shard_group": p.shard_group} if p.shard == "hybrid" else {}),
                     **({"shard_accumulate": p.shard_accumulate}
                        if p.shard_accumulate != "unsharded" else {})},
        "comm": {"scheduler": p.scheduler, "algorithm": p.algorithm, "compressor": p.compressor,
                 "sync": p.sync},
    }
    if p.servers:
        sections["ps"] = {"servers": p.servers, "consistency": p.consistency}
    if (p.tp == 1 or p.shard in FULLY_SHARDED) and p.pp == 1 and not p.servers and p.microbatches > 1:
        # whole replicas or fully sharded tp slices: the plan's micro-batches are gradient accumulation
        # (the data-parallel and fully sharded strategies have no parallel.microbatches)
        sections["optim"] = {"accumulate": p.microbatches}
    return sections


def _zoo_sections(model: str, global_batch: int, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`model` and `data` sections for a zoo spec (`gpt:layers=4`, `mlp:hidden=256`)."""
    name, _, args_text = model.strip().partition(":")
    args = parse_args(model, args_text)
    model_cfg: dict[str, Any] = {"name": name}
    data: dict[str, Any] = {"batch_size": global_batch}
    if name in ("gpt", "bert"):
        model_cfg.update({GPT_KEYS[k]: v for k, v in args.items() if k in GPT_KEYS})
        data.update({"name": "text", "seq_len": args.get("seq", 128)})
        if args.get("vocab", 256) != 256:
            notes.append(f"data.name=text is byte-level: the model gets vocab 256, not {args['vocab']}")
    else:
        model_cfg.update({k: v for k, v in args.items() if k in ("hidden", "depth", "channels")})
    return model_cfg, data


def _factory_section(spec: str) -> dict[str, Any]:
    """`package.module:factory[:key=value,...]` -> {"name": ..., "options": {...}} of a config."""
    head, _, rest = spec.strip().partition(":")
    target, _, args_text = rest.partition(":")
    section: dict[str, Any] = {"name": f"{head}:{target}"}
    options = parse_args(spec, args_text)
    if options:
        section["options"] = options
    return section


def _user_sections(model: str, data: str | None, global_batch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """`model` and `data` sections for a user's model factory and data set factory."""
    if data is None:
        raise UserError("--emit for your own model needs --data package.module:factory (the data set it "
                        "trains on), so that the config it writes runs as it is")
    return _factory_section(model), {**_factory_section(data), "batch_size": global_batch}
