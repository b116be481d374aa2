"""Deep Gradient Compression: momentum-corrected, sampled-threshold top-k sparsification (Lin et al. 2018)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from paraloom.compress.base import register
from paraloom.compress.topk import (
    check_density,
    count_kept,
    pack_sparse,
    scatter_sparse,
    shared_seed,
    sum_sparse,
    unpack_sparse,
)
from paraloom.config.errors import UserError

if TYPE_CHECKING:
    from paraloom.config import CommConfig, OptimConfig

def dgc_options(comm: CommConfig, optim: OptimConfig) -> dict[str, float] | None:
    """DGC's momentum correction replaces the optimizer's momentum (Lin et al. 2018): with SGD the
    compressor takes optim.momentum and the optimizer runs without it; Adam keeps its own moments,
    so DGC runs without momentum correction (sampled top-k with error feedback)."""
    if comm.compressor != "dgc":
        return None
    return {"momentum": optim.momentum if optim.name == "sgd" else 0.0}


MIN_SAMPLED_KEPT = 8  # the sample is grown until its own top set has this many entries (a stable quantile)


def fixed_size(device: torch.device) -> bool:
    """Whether DGC selects in fixed sizes on `device` (every device but the CPU: no host read)."""
    return device.type != "cpu"


@register("dgc")
class DGCCompressor:
    """Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018).

    Per bucket: optional local gradient clipping; momentum correction (u = m*u + g, v = v + u: the
    velocity, not the gradient, is accumulated and sparsified — the optimizer should then run
    without its own momentum); the top-k threshold is estimated from a random sample of |v|;
    momentum factor masking (u and v are zeroed where sent). With momentum=0 this is top-k with
    error feedback. Exponential sparsity warm-up: the first `warmup_steps` calls per bucket step
    through the densities 25%, 6.25%, 1.5625%, ... above the target (see `density_at`), then the target.

    Payloads are fixed-size (8k bytes for the current density: k fp32 values then k int32 indices,
    padded with value 0 at index 0) and all-gathered (not summable). k depends on the tensor size
    and the warm-up step only, so all ranks agree on it when they compress the same buckets.
    """

    summable = False
    state_fields = ("u", "v", "calls")
    retired_fields = ("generator",)  # the sampling stream's state, before it was drawn per (key, call)

    def __init__(self, density: float = 0.001, momentum: float = 0.9, clip_norm: float | None = None,
                 warmup_steps: int = 0, sample_fraction: float = 0.01, seed: int = 0) -> None:
        self.density = check_density(density)
        if not 0.0 <= momentum < 1.0:
            raise UserError(f"dgc momentum={momentum!r} must be in [0, 1)")
        if clip_norm is not None and clip_norm <= 0:
            raise UserError(f"dgc clip_norm={clip_norm!r} must be positive (or None for no clipping)")
        if warmup_steps < 0:
            raise UserError(f"dgc warmup_steps={warmup_steps!r} must be >= 0")
        if not 0.0 < sample_fraction <= 1.0:
            raise UserError(f"dgc sample_fraction={sample_fraction!r} must be in (0, 1]")
        self.momentum = float(momentum)
        self.clip_norm = clip_norm
        self.warmup_steps = int(warmup_steps)
        self.sample_fraction = float(sample_fraction)
        self.seed = int(seed)  # the threshold's sample: a stream of (seed, key, call), on the tensor's device
        self._generators: dict[torch.device, torch.Generator] = {}
        self.u: dict[int, torch.Tensor] = {}  # momentum
        self.v: dict[int, torch.Tensor] = {}  # accumulated velocity (the residual)
        self.calls: dict[int, int] = {}

    def density_at(self, step: int) -> float:
        """Density of call `step` (0-based). During warm-up the densities 25%, 6.25%, 1.5625%, ... that
        lie above the target take equal shares of the `warmup_steps` calls (Lin et al. 2018 give each
        an epoch); with as many warm-up steps as stages, call s has 0.25 ** (s + 1). Then the target."""
        if step < self.warmup_steps:
            stages = max(1, math.ceil(math.log(self.density) / math.log(0.25)) - 1)
            return max(self.density, 0.25 ** (1 + step * stages // self.warmup_steps))
        return self.density

    def payload_bytes(self, n: int, step: int | None = None) -> int:
        return 8 * count_kept(n, self.density_at(self.warmup_steps if step is None else step))

    def threshold(self, magnitudes: torch.Tensor, k: int, key: int = 0, call: int = 0) -> torch.Tensor:
        """Estimate the k-th largest of `magnitudes` from a random sample (Lin et al. 2018, §3), drawn
        on their device from a stream that depends on (seed, key, call) only: nothing to checkpoint,
        no copy to the device."""
        n = magnitudes.numel()
        size = min(n, max(math.ceil(self.sample_fraction * n), math.ceil(MIN_SAMPLED_KEPT * n / k)))
        if size >= n:
            return torch.topk(magnitudes, k, sorted=False).values.min()
        device = magnitudes.device
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed(shared_seed(self.seed, key, call))
        picks = torch.randint(n, (size,), generator=generator, device=device)
        kept = max(1, round(k * size / n))
        return torch.topk(magnitudes[picks], kept, sorted=False).values.min()

    def select(self, v: torch.Tensor, k: int, key: int = 0,
               call: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(k indices, which of them are sent): the largest |v| at or above the sampled threshold, at
        most k of them; the other slots are padding (index 0, not sent). On the CPU through `nonzero`
        (a data-dependent size costs nothing there); elsewhere through a top-k of |v| with the
        entries below the threshold pushed to -1, the same set in fixed sizes: no wait for the device."""
        magnitudes = v.abs()
        above = magnitudes >= self.threshold(magnitudes, k, key, call)
        if not fixed_size(v.device):
            chosen = torch.nonzero(above).view(-1)
            if chosen.numel() > k:
                chosen = chosen[torch.topk(magnitudes[chosen], k, sorted=False).indices]
            pad = k - chosen.numel()
            keep = torch.ones(k, dtype=torch.bool, device=v.device)
            if pad:
                keep[chosen.numel():] = False
                chosen = torch.cat([chosen, chosen.new_zeros(pad)])
            return chosen, keep
        keyed = torch.where(above, magnitudes, torch.full_like(magnitudes, -1.0))
        values, chosen = torch.topk(keyed, k, sorted=False)
        keep = values >= 0
        return torch.where(keep, chosen, torch.zeros_like(chosen)), keep

    def compress(self, tensor: torch.Tensor, key: int) -> tuple[torch.Tensor, Any]:
        """(8k-byte payload, ctx=(n, dtype, shape)); u and v for `key` are updated and masked."""
        g = tensor.detach().reshape(-1).to(torch.float32)
        n = g.numel()
        step = self.calls.get(key, 0)
        self.calls[key] = step + 1
        if self.clip_norm is not None and n:  # tensor ops only: no device sync
            g = g * (self.clip_norm / (torch.linalg.vector_norm(g) + 1e-12)).clamp(max=1.0)
        u = self.u.get(key)
        u = g.clone() if u is None else u.mul_(self.momentum).add_(g)
        v = self.v.get(key)
        v = u.clone() if v is None else v.add_(u)
        self.u[key], self.v[key] = u, v
        k = count_kept(n, self.density_at(step))
        if not k:
            return pack_sparse(v.new_zeros(0), torch.zeros(0, dtype=torch.long, device=g.device)), \
                (n, tensor.dtype, tensor.shape)
        chosen, keep = self.select(v, k, key, step)
        values = torch.where(keep, v[chosen], 0.0)  # padding sends 0 at index 0
        if fixed_size(v.device):  # momentum factor masking where sent, in fixed sizes
            sent = torch.zeros_like(v).index_add_(0, chosen, keep.to(v.dtype)) > 0
            u.masked_fill_(sent, 0.0)
            v.masked_fill_(sent, 0.0)
        else:
            sent = chosen[keep]
            u[sent] = 0.0
            v[sent] = 0.0
        return pack_sparse(values, chosen), (n, tensor.dtype, tensor.shape)

    def decompress_sum(self, payloads: torch.Tensor, ctx: Any, out: torch.Tensor) -> None:
        """Write the sum of the decoded rows of `payloads` (ranks x 8k bytes) into `out`, in one scatter."""
        out.copy_(sum_sparse(payloads, ctx[0]).view_as(out))

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        n, dtype, shape = ctx
        values, indices = unpack_sparse(payload)
        return scatter_sparse(values, indices, n, dtype, shape)
