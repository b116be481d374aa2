"""One device, predicted and measured: a model spec's training step time and peak memory.

The measured step is the one paraloom trains with on one device: the batch copied in from pinned
host memory, forward and loss under autocast (bf16, fp16) or in fp32 with fp32 weights, backward
(each transformer block recomputed in backward with `recompute`), AdamW's update, gradients set to
None. The step time is the median of `steps` steps after `warmup`, each bracketed by a device
synchronization; the peak is `torch.cuda.max_memory_allocated` over the measured steps (None on
the CPU). The prediction is the performance model's for one device (`Plan(dp=1)`) with the given
hardware profile: nothing here is fitted to the measurement.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.measure.microbench import DTYPES, synchronizer
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.measure.specs import build_from_spec
from paraloom.perfmodel.plan import Options, Plan


@dataclass(frozen=True)
class Case:
    """One configuration: a model spec, a batch, a dtype and whether blocks are recomputed."""

    label: str
    spec: str
    batch: int
    dtype: str = "bf16"
    recompute: bool = False


def predict(case: Case, hw: Hardware) -> dict[str, Any]:
    """The model's step seconds, peak bytes and their terms for `case` on one device of `hw`."""
    profile = profile_model(case.spec, dtype=case.dtype, recompute="full" if case.recompute else "none")
    est = estimate(profile, hw, Plan(dp=1), case.batch, Options(optimizer="adam"))
    return {"step_s": est.step_s, "peak_bytes": est.memory_bytes, "breakdown": est.breakdown,
            "parameters": profile.n_params}


def _recompute(model: torch.nn.Module) -> None:
    blocks = [m for m in model.modules() if hasattr(m, "recompute")]
    if not blocks:
        raise UserError(f"{type(model).__name__} has no blocks that recompute; recompute is for the gpt")
    for block in blocks:
        block.recompute = True


def measure(case: Case, device: torch.device, *, steps: int = 10, warmup: int = 3,
            trace_steps: int = 0) -> dict[str, Any]:
    """Median step seconds and peak bytes of training `case` on `device` (see the module's text);
    with `trace_steps`, torch.profiler's tables of that many more steps (`trace`)."""
    torch.manual_seed(0)
    model, make_input = build_from_spec(case.spec, device)
    model.train()
    if case.recompute:
        _recompute(model)
    x = make_input(case.batch)
    with torch.no_grad():
        classes = model(x[:1]).shape[-1]
    y = torch.randint(0, classes, (case.batch, *x.shape[1:]) if x.dtype == torch.long else (case.batch,),
                      device=device)
    host = x.cpu().pin_memory() if device.type == "cuda" else x.cpu()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(device.type, dtype=DTYPES[case.dtype], enabled=case.dtype != "fp32")
    sync, cuda = synchronizer(device), device.type == "cuda"

    def step() -> None:
        batch = host.to(device, non_blocking=True)
        with autocast:
            out = model(batch)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + steps):
        if cuda and i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        began = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
    out = {"step_s": statistics.median(times), "peak_bytes": peak, "steps": times,
           "phases_s": _phases(model, optimizer, host, y, autocast, device)}
    if trace_steps:
        out["trace"] = trace(step, device, trace_steps)
    return out  # the model and its optimizer go with this frame (compare then empties the cache)


def trace(step, device: torch.device, steps: int) -> str:
    """torch.profiler's tables of `steps` calls of `step`: the ops by device time, then by host time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(steps):
            step()
        synchronizer(device)()
    table = prof.key_averages()
    by_device = table.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25)
    return f"{steps} steps, by device time\n{by_device}\nby host time\n" \
           f"{table.table(sort_by='self_cpu_time_total', row_limit=15)}"


def _phases(model, optimizer, host, y, autocast, device) -> dict[str, float]:
    """One more step, synchronized between its parts: seconds of the copy, the forward with its loss,
    the backward and the update (after the timed steps, so their timing holds no extra syncs)."""
    sync, marks = synchronizer(device), []

    def mark() -> None:
        sync()
        marks.append(time.perf_counter())

    mark()
    batch = host.to(device, non_blocking=True)
    mark()
    with autocast:
        out = model(batch)
    loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
    mark()
    loss.backward()
    mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return dict(zip(("copy", "forward", "backward", "update"), gaps, strict=True))


def compare(cases: list[Case], hw: Hardware, device: torch.device, *, steps: int = 10, warmup: int = 3,
            traced: tuple[str, ...] = (), progress=lambda _: None) -> dict[str, Any]:
    """Each case predicted then measured, with the relative errors, and their median and maximum;
    the cases `traced` names also get torch.profiler's tables of two more steps (`trace`)."""
    rows = []
    for case in cases:
        progress(case.label)
        predicted = predict(case, hw)
        measured = measure(case, device, steps=steps, warmup=warmup,
                           trace_steps=2 if case.label in traced else 0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = {"case": case.label, "spec": case.spec, "batch": case.batch, "dtype": case.dtype,
               "recompute": case.recompute, "parameters": predicted["parameters"],
               "predicted_s": predicted["step_s"], "measured_s": measured["step_s"],
               "time_error": predicted["step_s"] / measured["step_s"] - 1,
               "predicted_bytes": predicted["peak_bytes"], "measured_bytes": measured["peak_bytes"],
               "breakdown": predicted["breakdown"], "measured_steps_s": measured["steps"],
               "measured_phases_s": measured["phases_s"]}
        if "trace" in measured:
            row["trace"] = measured["trace"]
        row["memory_error"] = (predicted["peak_bytes"] / measured["peak_bytes"] - 1
                               if measured["peak_bytes"] else None)
        rows.append(row)
    time_errors = [abs(r["time_error"]) for r in rows]
    memory_errors = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    return {"rows": rows,
            "time_error_median": statistics.median(time_errors), "time_error_max": max(time_errors),
            "memory_error_max": max(memory_errors) if memory_errors else None}


GPT = "gpt:layers={},hidden={},heads={},seq=1024,vocab=50304"
GPT_125M, GPT_350M = GPT.format(12, 768, 12), GPT.format(24, 1024, 16)
GPT_760M, GPT_1300M = GPT.format(24, 1536, 16), GPT.format(24, 2048, 16)
# GPT of 125M to 1.3B parameters at two batch sizes, bf16 and fp32, with and without recompute; ResNet-50
GPU_CASES = [
    Case("gpt-125m b8 bf16", GPT_125M, 8),
    Case("gpt-125m b16 bf16", GPT_125M, 16),
    Case("gpt-125m b8 fp32", GPT_125M, 8, "fp32"),
    Case("gpt-350m b8 bf16", GPT_350M, 8),
    Case("gpt-350m b8 bf16 recompute", GPT_350M, 8, recompute=True),
    Case("gpt-760m b8 bf16 recompute", GPT_760M, 8, recompute=True),
    Case("gpt-1.3b b4 bf16", GPT_1300M, 4),
    Case("gpt-1.3b b8 bf16 recompute", GPT_1300M, 8, recompute=True),
    Case("resnet50 b64 bf16", "resnet50", 64),
    Case("resnet50 b64 fp32", "resnet50", 64, "fp32"),
    # added after the first GPU run had shaped the model (autocast, loss, host and optimizer terms):
    # configurations it never saw
    Case("gpt-350m b16 bf16", GPT_350M, 16),
    Case("gpt-760m b4 fp32", GPT_760M, 4, "fp32"),
    Case("resnet50 b128 bf16", "resnet50", 128),
]
TINY_GPT = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256"
QUICK_CASES = [  # the same code on any device in seconds: a smoke run
    Case("tiny gpt b4 fp32", TINY_GPT, 4, "fp32"),
    Case("tiny gpt b8 bf16 recompute", TINY_GPT, 8, recompute=True),
    Case("mlp b32 fp32", "mlp:hidden=128", 32, "fp32"),
]
