"""`paraloom calibrate --device cuda`: an accelerator's hardware profile from micro-benchmarks on it.

Per dtype, the achieved FLOP/s of matmul, convolution, attention and element-wise work, the memory
bandwidth (a large copy), a kernel's launch (what a layer of small kernels waits on), host-device
copies from pinned memory and every compressor's encode + decode throughput on a gradient bucket
(perfmodel/measure/microbench.py). Nothing is fitted to training runs. The profile keeps the data sheet's
peaks where a preset names the part (so its efficiencies read as fractions of the published peak,
beside the preset's assumed ones) and records each measured rate as a constant
`flops.<dtype>.<class>`, which the model uses in place of peak x efficiency; the codecs' seconds
per byte (`codec_s_per_byte.<name>`) come from the engine's default 25 MB bucket. One device
measures no link: the links are the preset node's (NVLink inside a node, `inter` between nodes),
named as assumptions.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Any

import torch

from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.device import HOST, LAUNCH, UPDATE_PER_PARAM, UPDATE_PER_TENSOR
from paraloom.perfmodel.hardware import (
    OP_CLASSES,
    Device,
    Hardware,
    device_preset,
    device_preset_names,
    link_preset,
    network_nics,
    preset_node,
)
from paraloom.perfmodel.measure.microbench import (
    codec_rates,
    compute_rates,
    copy_rates,
    host_costs,
    launch_seconds,
    optimizer_costs,
)

BUCKETS_MB = (25, 100)  # the engine's default bucket, and a large one
CODEC_BUCKET_MB = 25
MAIN_DTYPES = ("bf16", "fp16", "fp32")  # the efficiencies are given for the first measured one with a peak


def preset_for(device_name: str) -> str | None:
    """The device preset a device's name matches ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    low = device_name.lower()
    found = [name for name in device_preset_names() if re.search(rf"\b{re.escape(name)}\b", low)]
    return max(found, key=len, default=None)  # "v100-pcie" before "v100"


def measure_device(device: torch.device, *, dtypes: tuple[str, ...] | None = None,
                   sizes: dict[str, Any] | None = None, min_s: float = 0.05,
                   buckets_mb: tuple[float, ...] = BUCKETS_MB, optimizer_sets: tuple | None = None,
                   progress=lambda _: None) -> dict[str, Any]:
    """Every micro-benchmark of `device`: compute per dtype, copies (CUDA), optimizers, codecs per
    bucket, capacity."""
    cuda = device.type == "cuda"
    dtypes = dtypes or (("fp32", "bf16", "fp16") if cuda else ("fp32", "bf16"))
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    out: dict[str, Any] = {"device": name, "torch": torch.__version__, "compute": {}, "codecs": {}}
    for dtype in dtypes:
        progress(f"compute in {dtype}: matmul, conv, attention, element-wise, memory bandwidth")
        out["compute"][dtype] = compute_rates(device, dtype, sizes=sizes, min_s=min_s)
    progress("a kernel's launch")
    out["launch_s"] = launch_seconds(device, min_s=min_s)
    if cuda:
        progress("host-device copies from pinned memory")
        out["copies"] = copy_rates(device, min_s=min_s)
        out["capacity"] = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        out["capacity"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    progress("the host's cost of issuing one op of each class, forward and backward")
    out["host"] = host_costs(device, min_s=min_s)
    progress("optimizers: a step of torch's SGD, SGD with momentum and AdamW")
    out["optimizers"] = optimizer_costs(device, sets=optimizer_sets, min_s=min_s)
    for mb in buckets_mb:
        progress(f"compressors: encode and decode of a {mb:g} MB bucket")
        out["codecs"][f"{mb:g}MB"] = codec_rates(device, int(mb * 2**20), min_s=min(min_s, 0.02))
    return out


def device_profile(measured: dict[str, Any], *, preset: str | None = None, inter: str = "ib-ndr",
                   name: str | None = None) -> tuple[Hardware, dict[str, Any]]:
    """(hardware profile, comparison) from `measure_device`'s figures.

    With `preset` (a device preset, by default the one the device's name matches) the peaks are
    the data sheet's and each op class's efficiency is its measured rate over that peak in the
    main dtype; without one, the measured matmul rate is each dtype's peak. The comparison lists,
    per dtype and op class, the preset's assumed efficiency beside the measured one."""
    preset = preset or preset_for(measured["device"])
    base = device_preset(preset) if preset else None
    compute = measured["compute"]
    peaks = dict(base.peak_flops) if base else {d: rates["matmul"] for d, rates in compute.items()}
    for dtype, rates in compute.items():  # a dtype the data sheet has no figure for: its matmul rate
        peaks.setdefault(dtype, rates["matmul"])
    main = next(d for d in (*MAIN_DTYPES, *compute) if d in compute)
    efficiency = {c: min(1.0, compute[main][c] / peaks[main]) for c in OP_CLASSES}
    bandwidth = max(rates["bandwidth"] for rates in compute.values())
    device = Device(name=preset or "measured", peak_flops=peaks, efficiency=efficiency,
                    mem_bandwidth=bandwidth, mem_capacity=measured["capacity"])
    constants = {f"flops.{d}.{c}": rates[c] for d, rates in compute.items() for c in OP_CLASSES}
    constants[LAUNCH] = measured["launch_s"]
    for direction, rate in measured.get("copies", {}).items():
        constants[f"copy_bandwidth.{direction}"] = rate
    for op_class, phases in measured.get("host", {}).items():
        constants.update({f"{HOST}.{op_class}.{phase}": seconds for phase, seconds in phases.items()})
    for optimizer, costs in measured.get("optimizers", {}).items():
        constants[f"{UPDATE_PER_PARAM}.{optimizer}"] = costs["per_param_s"]
        constants[f"{UPDATE_PER_TENSOR}.{optimizer}"] = costs["per_tensor_s"]
    codecs = measured["codecs"].get(f"{CODEC_BUCKET_MB}MB") or next(iter(measured["codecs"].values()), {})
    constants.update({f"codec_s_per_byte.{k}": 1.0 / v for k, v in codecs.items()})
    node = preset_node(preset) if preset else {}
    per_node, intra = node.get("devices_per_node", 1), link_preset(node.get("intra", "pcie4"))
    network = link_preset(inter)
    hw = Hardware(name=name or f"{preset or 'device'}-measured", device=device, devices_per_node=per_node,
                  intra=replace(intra, name=f"{intra.name} (preset, not measured)"),
                  inter=replace(network, name=f"{network.name} (preset, not measured)"), constants=constants,
                  nics_per_node=network_nics(inter, per_node))
    comparison = {
        "preset": preset, "main_dtype": main,
        "efficiency": {d: {c: {"assumed": base.efficiency[c] if base else None,
                               "measured": rates[c] / peaks[d]} for c in OP_CLASSES}
                       for d, rates in compute.items()},
        "mem_bandwidth": {"data_sheet": base.mem_bandwidth if base else None, "measured": bandwidth},
    }
    return hw, comparison


def check_device(text: str) -> torch.device:
    """`--device`: a CUDA device that torch can see, or a one-line error."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device {text!r} is not a device; use cuda or cuda:N") from None
    if device.type != "cuda":
        raise UserError(f"--device {text!r}: measuring a device is for GPUs (cuda, cuda:N); the CPU is "
                        "measured without --device")
    if not torch.cuda.is_available():
        raise UserError(f"--device {text!r}: no CUDA device is visible to torch {torch.__version__}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {text!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)
