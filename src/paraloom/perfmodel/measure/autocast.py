"""torch.autocast's casts on the meta device, where autocast does not act: a mixed-precision profile
counts the step that paraloom runs (fp32 weights, run.precision's autocast), casts included.

Autocast decides per op (torch.amp's op reference for CUDA): matrix products, convolutions and
attention run in the low precision, their floating inputs cast down (a weight once per forward, as
autocast caches the casts of leaf tensors); norms, softmax, losses and the other ops listed below run
in fp32, their inputs cast up; every other op runs in the type its inputs promote to. Each cast is
a real copy with its own backward, so the counters see its traffic both ways, as on a GPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

LOW = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv",
    "addr", "mv", "einsum", "chain_matmul", "multi_dot", "prelu", "scaled_dot_product_attention",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
})
FP32 = frozenset({
    "layer_norm", "group_norm", "softmax", "log_softmax", "softmin", "cross_entropy", "nll_loss",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits",
    "exp", "expm1", "log", "log1p", "log2", "log10", "rsqrt", "reciprocal", "pow", "__pow__", "__rpow__",
    "sum", "prod", "cumsum", "cumprod", "norm", "normalize", "softplus", "logsumexp", "cosine_similarity",
    "erfinv", "acos", "asin", "cosh", "sinh", "tan", "dist", "cdist", "pdist", "renorm",
})


class Autocast(TorchFunctionMode):
    """Casts as `torch.autocast(dtype=low)` would, for tensors on any device (meta included)."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # leaf id -> (leaf, its cast)

    def _down(self, t: object) -> object:
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32):
            return t
        if t.is_leaf and t.requires_grad:  # a weight: cast once per forward, as autocast caches it
            leaf, cast = self._weights.get(id(t), (None, None))
            if leaf is not t:
                cast = t.to(self.low)
                self._weights[id(t)] = (t, cast)
            return cast
        return t.to(self.low)

    @staticmethod
    def _up(t: object) -> object:
        floating = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.float() if floating and t.dtype != torch.float32 else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOW and "out" not in kwargs:
            args, kwargs = tree_map(self._down, (args, kwargs))
        elif name in FP32 and "out" not in kwargs and "dtype" not in kwargs:  # as autocast: explicit wins
            args, kwargs = tree_map(self._up, (args, kwargs))
        return func(*args, **kwargs)
