"""LARS: SGD with momentum and a per-tensor trust ratio (You et al. 2017, arXiv:1708.03888)."""

from __future__ import annotations

import torch

from paraloom.optim.trust import TrustRatioOptimizer, where_both_positive


class LARS(TrustRatioOptimizer):
    """Layer-wise Adaptive Rate Scaling, "Large Batch Training of Convolutional Networks" (Algorithm 1).

    Per parameter tensor w with gradient g, every step:

        local_lr = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)    (1 where ||w|| or ||g|| is 0)
        buf      = momentum * buf + local_lr * (g + weight_decay * w)
        w        = w - lr * buf

    The global `lr` multiplies the buffer on the way out (as torch.optim.SGD does) instead of
    going into it as in the paper's Algorithm 1; the two agree while `lr` is constant, and this
    way a learning-rate schedule acts at once and a group with `trust=False` is exactly
    `torch.optim.SGD(momentum=..., weight_decay=...)`.

    Biases and normalisation weights (1-d parameters) are usually left out of the adaptation
    (and of weight decay): put them in a parameter group with `trust=False` (and
    `weight_decay=0`), e.g. `LARS([{"params": weights}, {"params": biases, "trust": False,
    "weight_decay": 0.0}], lr=...)`. The norms are of whole tensors; for a flat shard of several
    tensors, or a tensor split over ranks, see `set_segments`.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 1e-3, eps: float = 1e-8, trust: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not eta > 0.0:
            raise ValueError(f"Invalid trust coefficient eta: {eta}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      eps=eps, trust=trust))

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        ratios = None
        if group["trust"]:
            eta, eps = group["eta"], group["eps"]
            ratios = self._trust_ratios(params, params, grads, lambda w, g: where_both_positive(
                w, g, eta * w / (g + wd * w + eps)))
        updates = torch._foreach_add(grads, params, alpha=wd) if wd else grads
        if ratios is not None:
            updates = torch._foreach_mul(updates, ratios)
        if momentum:
            bufs = [self._buffer(p) for p in params]
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, updates)
            updates = bufs
        torch._foreach_add_(params, updates, alpha=-lr)

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]
