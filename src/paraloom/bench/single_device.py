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

from paraloom.errors import UserError
from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.microbench import DTYPES, synchronizer
from paraloom.perfmodel.profile import profile_model
from paraloom.perfmodel.specs import build_from_spec
from paraloom.perfmodel.strategies import Options, Plan, estimate


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


def measure(case: Case, device: torch.device, *, steps: int = 10, warmup: int = 3) -> dict[str, Any]:
    """Median step seconds and peak bytes of training `case` on `device` (see the module's text)."""
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
    times = []
    for i in range(warmup + steps):
        if cuda and i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        began = time.perf_counter()
        batch = host.to(device, non_blocking=True)
        with autocast:
            out = model(batch)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
    phases = _phases(model, optimizer, host, y, autocast, device)
    del model, optimizer, out, loss
    if cuda:
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "peak_bytes": peak, "steps": times, "phases_s": phases}


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
            progress=lambda _: None) -> dict[str, Any]:
    """Each case predicted then measured, with the relative errors, and their median and maximum."""
    rows = []
    for case in cases:
        progress(case.label)
        predicted, measured = predict(case, hw), measure(case, device, steps=steps, warmup=warmup)
        row = {"case": case.label, "spec": case.spec, "batch": case.batch, "dtype": case.dtype,
               "recompute": case.recompute, "parameters": predicted["parameters"],
               "predicted_s": predicted["step_s"], "measured_s": measured["step_s"],
               "time_error": predicted["step_s"] / measured["step_s"] - 1,
               "predicted_bytes": predicted["peak_bytes"], "measured_bytes": measured["peak_bytes"],
               "breakdown": predicted["breakdown"], "measured_steps_s": measured["steps"],
               "measured_phases_s": measured["phases_s"]}
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
]
TINY_GPT = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256"
QUICK_CASES = [  # the same code on any device in seconds: a smoke run
    Case("tiny gpt b4 fp32", TINY_GPT, 4, "fp32"),
    Case("tiny gpt b8 bf16 recompute", TINY_GPT, 8, recompute=True),
    Case("mlp b32 fp32", "mlp:hidden=128", 32, "fp32"),
]
