"""`paraloom plan` and `paraloom calibrate`: the performance model's commands."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from paraloom.cli.options import cluster_from_options, link_timers
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.storage import READ_BANDWIDTH


def plan(
    cluster: Annotated[str, typer.Option(
        help="hardware preset (h100-ib-ndr, a100-hdr, v100-25gbe, ...) or a hardware YAML file")],
    config: Annotated[Path | None, typer.Argument(
        help="a `paraloom train` config: plan its model, data, batch, precision, recomputation and "
             "optimizer (the options below win); --emit lays the plan over it")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="SECTION.KEY=VALUE", help="override one key of CONFIG (repeatable)")] = None,
    model: Annotated[str | None, typer.Option(
        help="model spec: gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200, resnet50, vgg16, "
             "mlp:hidden=1024, or package.module:factory; or give a config")] = None,
    nodes: Annotated[str, typer.Option(help="node counts: 8, 1..64 (powers of two) or 1,2,3")] = "1..8",
    data: Annotated[str | None, typer.Option(
        help="your data set, package.module:factory[:key=value,...] (as data.name in a config): the "
             "example input of a model given as package.module:factory; the data set --emit names")
    ] = None,
    global_batch: Annotated[int | None, typer.Option(
        help="samples per optimizer step  [default: the config's data.batch_size, else 256]")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="fp32, fp16 or bf16 (mixed precision)  [default: the config's run.precision, else fp32]"),
    ] = None,
    recompute: Annotated[str | None, typer.Option(
        help="activation recomputation: none, selective (the attention core) or full  [default: the "
             "config's model.recompute, else none]")] = None,
    optimizer: Annotated[str | None, typer.Option(
        help="adam, momentum or sgd (optimizer state)  [default: the config's optim.name, else adam]"),
    ] = None,
    layout: Annotated[str, typer.Option(
        help="memory layout: ddp (paraloom's and torch DDP's: fp32 weights under autocast), or another "
             "framework's, the model in --dtype: megatron (fp32 main_grad), zero1, zero2, zero3")] = "ddp",
    sample_bytes: Annotated[str, typer.Option(
        help="a training sample as stored (e.g. '110 KB' for ImageNet's JPEGs), read from storage every "
             "step at the profile's storage.read_bandwidth while the step runs; 0: the data set in memory")
    ] = "0",
    plan_: Annotated[str | None, typer.Option(
        "--plan", metavar="dp=..,tp=..,pp=..,microbatches=..",
        help="predict this plan on the first node count instead of searching")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write every ranked plan here")] = None,
    emit: Annotated[Path | None, typer.Option(help="write the best plan as a paraloom train config")] = None,
    plot: Annotated[Path | None, typer.Option(help="draw throughput and efficiency by node count")] = None,
    efficiency_floor: Annotated[float, typer.Option(
        help="recommend the most nodes whose scaling efficiency stays at or above this")] = 0.7,
    exact_only: Annotated[bool, typer.Option(
        "--exact-only", help="only plans that keep synchronous SGD's math")] = False,
    top: Annotated[int, typer.Option(help="rows per table")] = 10,
) -> None:
    """Predict step time and memory of every parallel plan; recommend a plan and a node count."""
    from paraloom.cli.plan_command import run_plan

    given = {"model": model, "data": data, "global_batch": global_batch, "dtype": dtype,
             "recompute": recompute, "optimizer": optimizer}
    inputs, base = _plan_inputs(config, set_ or [], given)
    run_plan(cluster=cluster, nodes=nodes, plan=plan_, json_out=json_out, emit=emit, plot=plot,
             floor=efficiency_floor, exact_only=exact_only, top=top, layout=layout,
             sample_bytes=sample_bytes, base=base, **inputs)


PLAN_DEFAULTS = {"global_batch": 256, "dtype": "fp32", "recompute": "none", "optimizer": "adam"}


def _plan_inputs(config: Path | None, sets: list[str], given: dict) -> tuple[dict, dict | None]:
    """`paraloom plan`'s model, data, batch, precision, recomputation and optimizer: the options
    given, else the config's (with the config as written, for --emit), else the defaults."""
    chosen = {key: value for key, value in given.items() if value is not None}
    if config is None and not sets:
        if "model" not in chosen:
            raise UserError("paraloom plan needs --model SPEC or a `paraloom train` config file")
        return {**PLAN_DEFAULTS, "data": None, **chosen}, None
    from paraloom.config import load_config
    from paraloom.config.yaml_io import merge, parse_overrides, read_yaml
    from paraloom.perfmodel.from_config import plan_inputs

    if "model" in chosen:
        raise UserError("--model and a config both name the model: give one of them")
    base = merge(read_yaml(config) if config is not None else {}, parse_overrides(sets))
    return {**plan_inputs(load_config(config, sets)), **chosen}, base


def calibrate(
    out: Annotated[Path, typer.Option(help="hardware profile to write (YAML)")] = Path("hardware.yaml"),
    cluster: Annotated[str | None, typer.Option(help="measure inter-node links on emulated NAME")] = None,
    emulate: Annotated[str | None, typer.Option(
        metavar="NODESxRATE", help="emulate a cluster to measure inter-node links, e.g. 2x1gbit")] = None,
    devices_per_node: Annotated[int, typer.Option(help="workers per node the profile describes")] = 1,
    threads: Annotated[int, typer.Option(help="threads per worker while measuring compute")] = 1,
    from_: Annotated[list[Path] | None, typer.Option(
        "--from", metavar="RUN_DIR", help="refine --hardware from measured runs (repeatable; `history`: "
                                          "every run of `paraloom history` still on disk)")] = None,
    hardware: Annotated[str | None, typer.Option(help="the profile --from refines (preset or YAML)")] = None,
    group_sizes: Annotated[str | None, typer.Option(
        metavar="N,N", help="with an emulated cluster, also measure the all-reduce among N emulated nodes "
                            "at the same rate, e.g. 4,8 (plans with N data-parallel workers use it)")] = None,
    device: Annotated[str | None, typer.Option(
        help="measure this GPU (cuda, cuda:N) instead of the CPU: compute per dtype, memory, copies, codecs")
    ] = None,
    preset: Annotated[str | None, typer.Option(
        help="with --device: the data sheet the efficiencies are fractions of (h100, a100, t4, ...; "
             "default: the one the device's name matches)")] = None,
    inter: Annotated[str, typer.Option(help="with --device: the network preset between nodes")] = "ib-ndr",
    storage: Annotated[Path, typer.Option(
        help="where the training data lives: its read rate is measured there (a 128 MiB file, written, "
             "dropped from the page cache, read back)")] = Path(tempfile.gettempdir()),
) -> None:
    """Measure this machine into a hardware profile for `paraloom plan`, or refine one from runs."""
    from paraloom.perfmodel.hardware import load_hardware
    from paraloom.perfmodel.measure import calibrate as cal
    from paraloom.perfmodel.runs.finished import unusable
    from paraloom.perfmodel.runs.refine import refine

    if not out.parent.is_dir():
        raise UserError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")
    console = Console()
    if device is not None:
        if from_ or cluster or emulate or group_sizes:
            raise UserError("--device measures one GPU; --from, --cluster, --emulate and --group-sizes are "
                            "for the CPU and its links")
        _calibrate_device(device, preset, inter, out, console)
        return
    if from_:
        if hardware is None:
            raise UserError("--from refines a profile: name it with --hardware FILE")
        base = load_hardware(hardware)
        runs = _run_dirs(from_, unusable=lambda run: unusable(run, base), say=console.print)
        hw, points = refine(base, runs)
        for p in points:
            console.print(_point_line(p))
    else:
        if threads < 1 or devices_per_node < 1:
            raise UserError("--threads and --devices-per-node must be at least 1")
        sizes = _group_sizes(group_sizes)
        if sizes and cluster is None and emulate is None:
            raise UserError("--group-sizes measures emulated clusters: give --emulate NODESxRATE too")
        with cluster_from_options(cluster, emulate) as nodes, contextlib.ExitStack() as stack:
            groups = [stack.enter_context(_emulated_like(nodes, n)) for n in sizes if n != nodes.nodes]
            hw, _ = cal.calibrate(timers=link_timers(), cluster=nodes, devices_per_node=devices_per_node,
                                  threads=threads, group_clusters=groups, storage=storage,
                                  progress=lambda text: console.print(f"measuring {text}"))
    out.write_text(hw.to_yaml())
    read = hw.constants.get(READ_BANDWIDTH)
    d = hw.device
    console.print(f"matmul {d.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, "
                  f"memory {d.mem_bandwidth / 1e9:.1f} GB/s, "
                  f"intra {hw.intra.bandwidth / 1e6:.0f} MB/s + {hw.intra.latency * 1e6:.0f} us, "
                  f"inter {hw.inter.bandwidth / 1e6:.0f} MB/s + {hw.inter.latency * 1e6:.0f} us"
                  + (f", storage read {read / 1e6:.0f} MB/s" if read else "")
                  + _dispatch_summary(hw.constants) + f" -> {out}")


def _point_line(point: dict[str, Any]) -> str:
    """What refining took from one run (`runs.refine.refine`'s point of any kind), in one line."""
    if "server_s_per_message" in point:  # a parameter-server run
        update = point.get("server_s_per_update")
        return (f"{point['run']}: a server's CPU {point['server_s_per_message'] * 1e6:.0f} us a message"
                + ("" if update is None else f", {update * 1e6:.0f} us an update"))
    line = f"{point['run']}: measured {point['measured_s'] * 1e3:.1f} ms/step"
    if "sync_overhead_s" in point:  # a data-parallel run
        return (f"{line}, {point['comm_s'] * 1e3:.1f} ms of it communicating; the rest of the step "
                f"predicted {point['rest_s'] * 1e3:.1f} ms: synchronizing costs "
                f"{point['sync_overhead_s'] * 1e3:.2f} ms per core's share")
    return f"{line}, predicted before {point['predicted_s'] * 1e3:.1f} ms"


def _dispatch_summary(constants: dict[str, float]) -> str:
    """A CPU's dispatch per op, forward and backward, the median over op classes ("" where not measured)."""
    phases = {phase: [v for k, v in constants.items() if k.startswith("dispatch_s.") and k.endswith(phase)]
              for phase in (".fwd", ".bwd")}
    if not all(phases.values()):
        return ""
    fwd, bwd = (statistics.median(values) * 1e6 for values in phases.values())
    return f", dispatch {fwd:.0f} us an op forward, {bwd:.0f} us backward"


def _run_dirs(given: list[Path], *, unusable: Callable[[Path], str | None] = lambda run: None,
              say: Callable[[str], None] = print) -> list[Path]:
    """--from's run directories; the word `history` stands for every finished run the history lists
    that can be fitted to (`unusable` gives why not: the runs passed over are counted in one line,
    the first named with its reason). A run directory given by name is always kept."""
    from paraloom.perfmodel.runs import history

    out = []
    for item in given:
        if str(item) != "history":
            out.append(item)
            continue
        found = history.finished_run_dirs(history.read())
        if not found:
            raise UserError(f"--from history: {history.history_path()} lists no run directory still on disk")
        reasons = {run: unusable(run) for run in found}
        passed = [(run, why) for run, why in reasons.items() if why is not None]
        if len(passed) == len(found):
            raise UserError(f"--from history: none of its {len(found)} runs can be fitted to; the first, "
                            f"{passed[0][0]}: {passed[0][1]}")
        if passed:
            say(f"--from history: passed over {len(passed)} of {len(found)} runs (the first, "
                f"{passed[0][0]}: {passed[0][1]})")
        out += [run for run in found if reasons[run] is None]
    return out


def history(
    last: Annotated[int, typer.Option(help="rows to show, newest last")] = 20,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="write the history and the scores here")] = None,
) -> None:
    """Past runs: what each predicted of itself and measured; white, grey and black boxes scored on them."""
    import json

    from rich.table import Table

    from paraloom.perfmodel.runs import fitted
    from paraloom.perfmodel.runs import history as past

    runs = past.read()
    console = Console()
    if not runs:
        console.print(f"no runs yet in {past.history_path()}")
        return
    table = Table(title=f"{len(runs)} runs in {past.history_path()}")
    for column in ("date", "run", "model", "workers", "hardware", "predicted ms", "measured ms", "error"):
        numbers = "ms" in column or column in ("workers", "error")
        table.add_column(column, justify="right" if numbers else "left")
    for run in runs[-last:]:
        predicted, measured = run.get("predicted") or {}, run.get("measured") or {}
        p, m = predicted.get("step_seconds"), measured.get("step")
        table.add_row(run["date"], Path(run["run_dir"]).name, run["config"].get("model", {}).get("name", "?"),
                      str(run.get("world_size")), predicted.get("hardware", "-"),
                      "-" if p is None else f"{p * 1e3:.2f}", "-" if m is None else f"{m * 1e3:.2f}",
                      "-" if p is None or not m else f"{p / m - 1:+.0%}")
    console.print(table)
    scores = fitted.leave_one_out(runs)
    for box in ("white", "grey", "black"):
        if scores[box] is not None:
            console.print(f"{box}: leave-one-out median error {scores[box]['median_abs_err']:.1%}, "
                          f"max {scores[box]['max_abs_err']:.1%} over {scores['n']} runs")
    if json_out is not None:
        json_out.write_text(json.dumps({"runs": runs, "leave_one_out": scores}, indent=1) + "\n")


def _calibrate_device(text: str, preset: str | None, inter: str, out: Path, console: Console) -> None:
    """`calibrate --device`: measure the GPU, write its profile, show its efficiencies beside the preset's."""
    from rich.table import Table

    from paraloom.perfmodel.hardware import device_preset, link_preset
    from paraloom.perfmodel.measure.device_profile import check_device, device_profile, measure_device

    if preset is not None:
        device_preset(preset)
    link_preset(inter)
    gpu = check_device(text)
    measured = measure_device(gpu, progress=lambda what: console.print(f"measuring {what}"))
    hw, comparison = device_profile(measured, preset=preset, inter=inter)
    out.write_text(hw.to_yaml())
    table = Table(title=f"{measured['device']}: efficiency, achieved / peak "
                        f"({comparison['preset'] or 'no preset: measured matmul'} peaks)")
    for column in ("dtype", "class", "assumed (preset)", "measured", "TFLOP/s"):
        table.add_column(column)
    for dtype, classes in comparison["efficiency"].items():
        for op_class, pair in classes.items():
            assumed = "-" if pair["assumed"] is None else f"{pair['assumed']:.2f}"
            table.add_row(dtype, op_class, assumed, f"{pair['measured']:.3f}",
                          f"{hw.constants[f'flops.{dtype}.{op_class}'] / 1e12:.1f}")
    console.print(table)
    bandwidth = comparison["mem_bandwidth"]
    sheet = bandwidth["data_sheet"]
    sheet = "" if sheet is None else f" (data sheet {sheet / 1e12:.2f} TB/s)"
    gib = hw.device.mem_capacity / 2**30
    console.print(f"memory {bandwidth['measured'] / 1e12:.2f} TB/s{sheet}, {gib:.1f} GiB; "
                  f"links {hw.intra.name}, {hw.inter.name} -> {out}")


def _group_sizes(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise UserError(f"--group-sizes {text!r} must be node counts separated by commas, e.g. 4,8") from None
    if sizes[0] < 2:
        raise UserError(f"--group-sizes {text!r}: a group has at least 2 nodes")
    return sizes


def _emulated_like(cluster, nodes: int):
    """A new emulated cluster of `nodes` nodes at `cluster`'s link rate."""
    from paraloom.cluster import ClusterSpec, EmulatedCluster, free_name

    return EmulatedCluster(ClusterSpec(nodes=nodes, rate_bits=cluster.spec.rate_bits, name=free_name("cal")))
