"""PowerSGD low-rank compression math, split at its two all-reduces (Vogels, Karimireddy & Jaggi 2019)."""

from __future__ import annotations

import math

import torch

from paraloom.compress.topk import shared_seed
from paraloom.config.errors import UserError


def matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of 2 or more dimensions as (shape[0], rest) (Vogels et al. 2019, §3: conv kernels too)."""
    return tensor.reshape(tensor.shape[0], -1)


def orthogonalize(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormal columns by modified Gram-Schmidt (deterministic; a zero column stays zero)."""
    out = matrix.clone()
    for i in range(out.shape[1]):
        col = out[:, i]
        col /= torch.linalg.vector_norm(col) + eps
        if i + 1 < out.shape[1]:
            rest = out[:, i + 1:]
            rest -= torch.outer(col, col @ rest)
    return out


class PowerSGDState:
    """Rank-r PowerSGD with error feedback and warm start (Vogels et al. 2019, Algorithm 1 and 2).

    Per matrix M (a gradient of 2+ dimensions, viewed as rows x cols), one step is:

        P = p_matrices(key, grad)        # M = grad + e; P = M Q        -> caller all-reduces P (sum)
        Q = q_matrices(key, P_summed)    # P^ = orth(P_summed); Q = M^T P^ -> caller all-reduces Q (sum)
        A = decompress(key, Q_summed)    # A = P^ Q_summed^T, the SUM over ranks of their approximations

    Sums, not means: divide A by the world size for the average. The error memory is this rank's own
    loss e = M - P^ P^T M (= M - P^ Q_local^T); summed over ranks it equals the paper's total error
    (I - P^ P^T) sum(M), and it needs no world size. With warm start, the all-reduced Q (identical on
    every rank) seeds the next step; otherwise Q is drawn from a generator seeded with
    (seed, key, call count), so every rank draws the same Q without communication.

    Call `next_iteration()` once per training step: before `start_iter` steps `should_compress` says
    False and callers send gradients plainly (no error is recorded then, as in the paper's warm-up).
    """

    state_fields = ("iteration", "errors", "q_memory", "calls")

    def __init__(self, rank: int = 2, start_iter: int = 10, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 0) -> None:
        if rank < 1:
            raise UserError(f"powersgd rank={rank!r} must be >= 1")
        if start_iter < 0:
            raise UserError(f"powersgd start_iter={start_iter!r} must be >= 0")
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.warm_start = warm_start
        self.error_feedback = error_feedback
        self.seed = int(seed)
        self.iteration = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.q_memory: dict[int, torch.Tensor] = {}
        self.calls: dict[int, int] = {}
        self._m: dict[int, torch.Tensor] = {}  # this step's error-corrected matrix, between the calls
        self._p: dict[int, torch.Tensor] = {}  # this step's orthogonalized P^
        self._q: dict[int, torch.Tensor] = {}  # this step's local Q = M^T P^
        self._owned: set[int] = set()  # keys whose M is the error memory itself (rewritten in place)

    def next_iteration(self) -> None:
        self.iteration += 1

    def rank_for(self, shape: torch.Size | tuple[int, ...]) -> int:
        rows, cols = shape[0], math.prod(shape[1:])
        return min(self.rank, rows, cols)

    def should_compress(self, shape: torch.Size | tuple[int, ...]) -> bool:
        """False for 1-D tensors, when P and Q would not be smaller than the matrix, and before start_iter."""
        if len(shape) < 2 or self.iteration < self.start_iter:
            return False
        rows, cols = shape[0], math.prod(shape[1:])
        return self.rank * (rows + cols) < rows * cols

    def payload_elements(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        """Elements of P and of Q that go on the wire for a tensor of `shape`."""
        r = self.rank_for(shape)
        return shape[0] * r, math.prod(shape[1:]) * r

    def _initial_q(self, key: int, cols: int, r: int, device: torch.device) -> torch.Tensor:
        count = self.calls.get(key, 0)
        self.calls[key] = count + 1
        if self.warm_start:
            kept = self.q_memory.get(key)
            if kept is not None and kept.shape == (cols, r):
                return kept
            count = 0
        generator = torch.Generator().manual_seed(shared_seed(self.seed, key, count))
        return orthogonalize(torch.randn(cols, r, generator=generator)).to(device)

    def p_matrices(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """P = M Q with M = grad (as rows x cols) + error memory; all-reduce (sum) the result.

        The error memory, when there is one, becomes M in place (it is rewritten in `decompress`)."""
        m = matrix_view(grad.detach()).to(torch.float32)
        kept = self.errors.pop(key, None) if self.error_feedback else None
        if kept is not None and kept.shape == m.shape:
            m = kept.add_(m)
            self._owned.add(key)
        self._m[key] = m
        q = self._initial_q(key, m.shape[1], self.rank_for(grad.shape), m.device)
        return (q.T @ m.T).T  # = M Q; this order runs a fast kernel on CPU (M.T @ P is ~20x slower)

    def q_matrices(self, key: int, p_summed: torch.Tensor) -> torch.Tensor:
        """Q = M^T orth(P_summed); all-reduce (sum) the result."""
        p = orthogonalize(p_summed.to(torch.float32))
        q = (p.T @ self._m[key]).T  # = M^T P^, without a transposed matrix times a thin one
        self._p[key], self._q[key] = p, q
        return q

    def decompress(self, key: int, q_summed: torch.Tensor, shape: torch.Size | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """P^ Q_summed^T (the sum of all ranks' approximations), written into `out` (rows x cols, or
        any view of that many elements) or shaped like the gradient when `shape` is given; updates
        the error memory and, with warm start, keeps Q_summed for the next step."""
        m, p, q_local = self._m.pop(key), self._p.pop(key), self._q.pop(key)
        owned = key in self._owned
        self._owned.discard(key)
        q_summed = q_summed.to(torch.float32)
        p_rows = p.T.contiguous()  # rank-1 updates of contiguous rows: the fast kernel for small r
        if self.error_feedback:
            error = m if owned else m.clone()  # m may be a view of the caller's gradient
            for j, row in enumerate(q_local.T.contiguous()):
                error.addr_(p_rows[j], row, alpha=-1.0)
            self.errors[key] = error
        if self.warm_start:
            self.q_memory[key] = q_summed.clone()
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
        approx = out.view(p.shape[0], -1) if direct else torch.empty(p.shape[0], q_summed.shape[0],
                                                                      device=p.device)
        for j, row in enumerate(q_summed.T.contiguous()):
            if j == 0:
                torch.outer(p_rows[0], row, out=approx)
            else:
                approx.addr_(p_rows[j], row)
        if out is not None:
            if not direct:
                out.copy_(approx.view_as(out))
            return out
        return approx if shape is None else approx.view(shape)
