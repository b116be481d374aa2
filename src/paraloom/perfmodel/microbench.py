"""Micro-benchmarks of one device, CPU or CUDA: compute by op class and dtype, memory bandwidth,
a kernel's launch, host-device copies, and each compressor's encode + decode throughput on a
gradient bucket.

Each figure is work over the median time of repeated samples after a warm-up; on CUDA a sample is
bracketed by `torch.cuda.synchronize`, so it times the kernels, not their launch. Sizes are small
on the CPU (one worker's share of a few cores) and large on a GPU (enough to fill it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# per device type: matmul n; conv (batch, channels, side); attention (batch, heads, seq, head dim); elements
SIZES = {"cpu": {"matmul": 512, "conv": (8, 32, 32), "attention": (4, 4, 128, 32), "elements": 2**23},
         "cuda": {"matmul": 8192, "conv": (64, 128, 56), "attention": (8, 16, 2048, 64), "elements": 2**27}}


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for `device` to finish its queued work (nothing on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def rate(fn: Callable[[], Any], work: float, *, device: torch.device = torch.device("cpu"),
         repeats: int = 7, min_s: float = 0.05) -> float:
    """work / median seconds of `fn` (each sample repeats `fn` until it lasts `min_s`)."""
    sync = synchronizer(device)
    fn()
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_s:
        fn()
        sync()  # count finished calls: on a GPU `fn` only queues its kernels, far faster than they run
        calls += 1
    calls = max(1, calls)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t) / calls)
    return work / statistics.median(samples)


@torch.no_grad()
def compute_rates(device: torch.device, dtype: str = "fp32", *, sizes: dict[str, Any] | None = None,
                  min_s: float = 0.05) -> dict[str, float]:
    """FLOP/s of matmul, 3x3 convolution, causal attention and element-wise work in `dtype`, and
    memory bandwidth (bytes/s of a large copy) on `device`."""
    size = sizes or SIZES[device.type]
    kind = {"device": device, "dtype": DTYPES[dtype]}
    n = size["matmul"]
    a, b = torch.randn(n, n, **kind), torch.randn(n, n, **kind)
    batch, channels, side = size["conv"]
    x, w = torch.randn(batch, channels, side, side, **kind), torch.randn(channels, channels, 3, 3, **kind)
    heads_batch, heads, seq, head_dim = size["attention"]
    q = torch.randn(heads_batch, heads, seq, head_dim, **kind)
    big = torch.randn(size["elements"], **kind)
    out = torch.empty_like(big)
    timed = {"device": device, "min_s": min_s}
    return {
        "matmul": rate(lambda: a @ b, 2 * n**3, **timed),
        "conv": rate(lambda: F.conv2d(x, w, padding=1), 2 * batch * side * side * channels * channels * 9,
                     **timed),
        # QK^T and PV at 2 FLOP a multiply-add, as the model profile counts them (causal or not)
        "attention": rate(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                          4 * heads_batch * heads * seq * seq * head_dim, **timed),
        "other": rate(lambda: torch.add(big, 1.0, out=out), big.numel(), **timed),
        "bandwidth": rate(lambda: out.copy_(big), 2 * big.numel() * big.element_size(), **timed),
    }


def launch_seconds(device: torch.device, *, min_s: float = 0.05) -> float:
    """Seconds per kernel of a stream of tiny ones (a one-element add): what the host needs to issue
    a kernel, or the device to run an empty one, whichever is slower."""
    x = torch.zeros(1, device=device)
    return 1.0 / rate(lambda: x.add_(1.0), 1.0, device=device, min_s=min_s)


def copy_rates(device: torch.device, nbytes: int = 2**28, *, min_s: float = 0.05) -> dict[str, float]:
    """Bytes/s of host-to-device and device-to-host copies from and to pinned memory (CUDA only)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return {"h2d": rate(lambda: dev.copy_(host, non_blocking=True), nbytes, device=device, min_s=min_s),
            "d2h": rate(lambda: host.copy_(dev, non_blocking=True), nbytes, device=device, min_s=min_s)}


def codec_rates(device: torch.device, bucket_bytes: int, names: list[str] | None = None, *,
                min_s: float = 0.02) -> dict[str, float]:
    """Bytes/s of fp32 gradient that each registered compressor encodes and decodes (one bucket, one
    round trip; PowerSGD, a multi-round reducer rather than a codec, is not among them)."""
    from paraloom.compress import COMPRESSORS, make_compressor

    grad = torch.randn(bucket_bytes // 4, device=device)
    out = {}
    for name in names or sorted(COMPRESSORS):
        codec = make_compressor(name)

        def roundtrip(codec=codec):
            payload, ctx = codec.compress(grad, 0)
            codec.decompress(payload, ctx)

        out[name] = rate(roundtrip, float(bucket_bytes), device=device, repeats=3, min_s=min_s)
    return out
