"""Micro-benchmarks of one device, CPU or CUDA: compute by op class and dtype, memory bandwidth,
a kernel's launch, host-device copies, each compressor's encode + decode throughput on a gradient
bucket, and torch's own optimizers' step (per parameter and per tensor).

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

from paraloom.optim.optimizers import make_optimizer

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


# per device type: (tensors, elements each) of a parameter set whose step is bound by memory traffic,
# and of one bound by the work done per tensor (launches, and the host's Python around them)
OPTIMIZER_SETS = {"cpu": ((4, 2**20), (64, 256)), "cuda": ((4, 2**24), (256, 1024))}
# built as a run builds them (optim/optimizers.py): torch's fused kernel wherever the class and the
# parameters allow it, which is not the default implementation's speed (a tenth of its time for Adam
# on a CPU; one kernel for all tensors on a GPU, where the default is foreach)
OPTIMIZERS = {"sgd": lambda ps: make_optimizer("sgd", ps, lr=1e-3),
              "momentum": lambda ps: make_optimizer("sgd", ps, lr=1e-3, momentum=0.9),
              "adam": lambda ps: make_optimizer("adamw", ps, lr=1e-3)}


def optimizer_costs(device: torch.device, *, sets: tuple | None = None,
                    min_s: float = 0.05) -> dict[str, dict[str, float]]:
    """Seconds per parameter and per parameter tensor of each optimizer's `step()` on `device`, built
    as a run builds it (`OPTIMIZERS`): timed on a set of few large tensors and one of many small
    ones, the two costs solved from the pair (neither below zero)."""
    (big_n, big_size), (small_n, small_size) = sets or OPTIMIZER_SETS[device.type]
    out = {}
    for name, make in OPTIMIZERS.items():
        seconds = []
        for n, size in ((big_n, big_size), (small_n, small_size)):
            params = [torch.zeros(size, device=device, requires_grad=True) for _ in range(n)]
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            optimizer = make(params)
            seconds.append(1.0 / rate(optimizer.step, 1.0, device=device, repeats=5, min_s=min_s))
            del optimizer, params
        # t = per_tensor * n + per_param * n * size, for both sets
        det = big_n * small_n * small_size - small_n * big_n * big_size
        per_param = (seconds[1] * big_n - seconds[0] * small_n) / det
        per_tensor = (seconds[0] - per_param * big_n * big_size) / big_n
        if per_tensor < 0:  # no measurable cost per tensor: all of it per parameter
            per_tensor, per_param = 0.0, seconds[0] / (big_n * big_size)
        out[name] = {"per_param_s": max(per_param, 0.0), "per_tensor_s": per_tensor}
    return out


def _host_ops(device: torch.device) -> dict[str, tuple]:
    """Per op class: (its input, one weight of the chain, the op) on tensors so small that only
    issuing them counts; each op's output has its input's shape, so ops chain."""
    def w(*shape):
        return lambda: torch.randn(*shape, device=device, requires_grad=True)

    return {
        "matmul": ((4, 16), w(16, 16), F.linear),
        "conv": ((1, 4, 8, 8), w(4, 4, 3, 3), lambda x, k: F.conv2d(x, k, padding=1)),
        "attention": ((1, 1, 8, 16), lambda: None,
                      lambda x, _: F.scaled_dot_product_attention(x, x, x, is_causal=True)),
        "other": ((4, 16), lambda: None, lambda x, _: F.gelu(x)),
    }


def host_costs(device: torch.device, *, chain: int = 32, min_s: float = 0.05) -> dict[str, dict[str, float]]:
    """Seconds the host spends on one op of each class, forward and backward, in eager PyTorch with
    autograd: the cost of issuing it (dispatch, the library's own setup, the launch), which a step of
    many small ops pays whatever the device's speed. Measured on a chain of `chain` tiny ops, forward
    alone and forward with backward; a layer is no faster than its ops can be issued."""
    out = {}
    for name, (shape, weight, op) in _host_ops(device).items():
        x = torch.randn(*shape, device=device, requires_grad=True)
        weights = [weight() for _ in range(chain)]

        def forward(x=x, weights=weights, op=op):
            y = x
            for k in weights:
                y = op(y, k)
            return y

        def both(forward=forward, grad=torch.ones(shape, device=device)):
            forward().backward(gradient=grad)

        fwd = 1.0 / rate(forward, 1.0, device=device, repeats=5, min_s=min_s)
        total = 1.0 / rate(both, 1.0, device=device, repeats=5, min_s=min_s)
        out[name] = {"fwd": fwd / chain, "bwd": max(total - fwd, 0.0) / chain}
    return out
