"""PowerSGDState against the algorithm written out with plain matrix products (Vogels et al. 2019)."""

import torch

from paraloom.compress.powersgd import PowerSGDState, orthogonalize


def _reference(grads_per_step: list[list[torch.Tensor]], rank: int) -> list[torch.Tensor]:
    """Averaged approximations per step, for ranks whose gradients are grads_per_step[t][r]."""
    world = len(grads_per_step[0])
    errors = [torch.zeros_like(grads_per_step[0][0]) for _ in range(world)]
    q = None
    out = []
    for t, grads in enumerate(grads_per_step):
        ms = [g + e for g, e in zip(grads, errors, strict=True)]
        if q is None:  # the state's first Q: drawn from the shared seed, step 0
            state = PowerSGDState(rank=rank, start_iter=0)
            q = state._initial_q(0, grads[0].shape[1], rank, torch.device("cpu"))
        p = orthogonalize(sum(m @ q for m in ms))
        q_locals = [m.T @ p for m in ms]
        q = sum(q_locals)
        out.append(p @ q.T / world)
        errors = [m - p @ ql.T for m, ql in zip(ms, q_locals, strict=True)]
        assert t == len(out) - 1
    return out


def test_three_steps_with_error_feedback_and_warm_start_match_the_written_out_algorithm():
    torch.manual_seed(0)
    rank, world, steps = 2, 3, 3
    grads = [[torch.randn(40, 24) for _ in range(world)] for _ in range(steps)]
    expected = _reference(grads, rank)
    states = [PowerSGDState(rank=rank, start_iter=0) for _ in range(world)]
    for t in range(steps):
        ps = [s.p_matrices(0, g) for s, g in zip(states, grads[t], strict=True)]
        p_sum = sum(ps)
        q_sum = sum(s.q_matrices(0, p_sum) for s in states)
        outs = [torch.full((40 * 24,), float("nan")) for _ in states]
        for s, o in zip(states, outs, strict=True):
            s.decompress(0, q_sum, out=o)  # written in place, as the engine does
        for o in outs:
            torch.testing.assert_close(o.view(40, 24) / world, expected[t], rtol=1e-5, atol=1e-6)
    for t in range(steps):  # the caller's gradients were never written to
        assert all(torch.isfinite(g).all() for g in grads[t])


def test_decompress_does_not_touch_the_gradient_it_was_given_on_the_first_step():
    grad = torch.randn(16, 12)
    kept = grad.clone()
    state = PowerSGDState(rank=1, start_iter=0)
    p = state.p_matrices(0, grad)
    approx = state.decompress(0, state.q_matrices(0, p), grad.shape)
    assert torch.equal(grad, kept)  # the error memory is a copy, not the gradient itself
    torch.testing.assert_close(state.errors[0], grad - approx)
