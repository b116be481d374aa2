"""Textbook LARS and LAMB, one tensor at a time in plain Python loops: what paraloom.optim must match."""

import torch

SHAPES = [(4, 3), (7,), (4, 4), (2,), (4,)]  # 41 elements: ends at 12, 19, 35, 37, 41
# blocks of 2 ranks (21 + 1 padding) and of 3 (14 + 1 padding) cut through tensors


def make_tensors(dtype=torch.float64) -> list[torch.Tensor]:
    """Start values; the (2,) tensor is all zeros, so its trust ratio is 1 on the first step."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen, dtype=dtype) for shape in SHAPES]
    tensors[3].zero_()
    return tensors


def noise(n_steps: int, dtype=torch.float64) -> list[list[torch.Tensor]]:
    """noise[step][i]: the data part of tensor i's gradient at that step."""
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=gen, dtype=dtype) for shape in SHAPES] for _ in range(n_steps)]


def grad(w: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """An elementwise gradient (0.5 w + noise), so a shard of w gives the shard of the gradient."""
    return 0.5 * w + noise


def lars(tensors, noises, *, lr, momentum, weight_decay, eta=1e-3, eps=1e-8):
    ws = [t.clone() for t in tensors]
    bufs = [torch.zeros_like(w) for w in ws]
    for step_noise in noises:
        for i in range(len(ws)):
            w, g = ws[i], grad(ws[i], step_noise[i])
            w_norm, g_norm = w.norm(), g.norm()
            if w_norm > 0 and g_norm > 0:
                local_lr = eta * w_norm / (g_norm + weight_decay * w_norm + eps)
            else:
                local_lr = 1.0
            bufs[i] = momentum * bufs[i] + local_lr * (g + weight_decay * w)
            ws[i] = w - lr * bufs[i]
    return ws


def lamb(tensors, noises, *, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay):
    beta1, beta2 = betas
    ws = [t.clone() for t in tensors]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, step_noise in enumerate(noises, start=1):
        for i in range(len(ws)):
            w, g = ws[i], grad(ws[i], step_noise[i])
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            m_hat = ms[i] / (1 - beta1 ** t)
            v_hat = vs[i] / (1 - beta2 ** t)
            r = m_hat / (v_hat.sqrt() + eps) + weight_decay * w
            w_norm, r_norm = w.norm(), r.norm()
            ratio = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            ws[i] = w - lr * ratio * r
    return ws
