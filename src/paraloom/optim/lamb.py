"""LAMB: Adam moments with a per-tensor trust ratio (You et al. 2019, arXiv:1904.00962)."""

from __future__ import annotations

import math

import torch

from paraloom.optim.trust import TrustRatioOptimizer, where_both_positive


class LAMB(TrustRatioOptimizer):
    """Layer-wise Adaptive Moments for Batch training, "Large Batch Optimization for Deep Learning:
    Training BERT in 76 minutes" (Algorithm 2, with phi the identity).

    Per parameter tensor w with gradient g, at step t (from 1):

        m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g**2
        r = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w
        w = w - lr * (||w|| / ||r||) * r          (ratio 1 where ||w|| or ||r|| is 0)

    Weight decay is decoupled (inside r, as AdamW). A parameter group with `trust=False` skips
    the ratio (AdamW with the decay scaled by lr): the usual choice for biases and normalisation
    weights, together with `weight_decay=0`. The norms are of whole tensors; for a flat shard of
    several tensors, or a tensor split over ranks, see `set_segments`.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"Invalid betas: {betas}; each must lie in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                                      trust=trust))

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        counts = [float(t) for t in steps]  # CPU scalars, as torch.optim.Adam keeps them: no sync
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** t) for t in counts])
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        torch._foreach_div_(updates, [1 - beta1 ** t for t in counts])
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        if group["trust"]:
            ratios = self._trust_ratios(params, params, updates,
                                        lambda w, r: where_both_positive(w, r, w / r))
            torch._foreach_mul_(updates, ratios)
        torch._foreach_add_(params, updates, alpha=-group["lr"])

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
