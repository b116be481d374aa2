"""Top-k, random-k, DGC and PowerSGD: exact payload sizes, right selections, bounded error feedback."""

import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

from paraloom.compress.base import COMPRESSORS, make_compressor
from paraloom.compress.dgc import DGCCompressor
from paraloom.compress.powersgd import PowerSGDState, orthogonalize
from paraloom.compress.topk import RandomKCompressor, TopKCompressor
from paraloom.config.errors import UserError


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_the_sparsifiers_are_registered():
    assert {"topk", "randomk", "dgc"} <= COMPRESSORS.keys()
    assert isinstance(make_compressor("topk", density=0.5), TopKCompressor)
    with pytest.raises(UserError, match="density"):
        make_compressor("topk", density=0.0)


# ---- payload sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 1000])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.3, 1.0])
def test_payload_sizes_are_exact(n, density):
    k = 0 if n == 0 else max(1, math.ceil(density * n))
    g = torch.randn(n, generator=_gen(n))
    for comp in (TopKCompressor(density), DGCCompressor(density)):
        payload, ctx = comp.compress(g, key=0)
        assert payload.dtype == torch.uint8 and payload.shape == (8 * k,)
        assert comp.payload_bytes(n) == 8 * k
        assert comp.decompress(payload, ctx).shape == g.shape
    rk = RandomKCompressor(density)
    payload, ctx = rk.compress(g, key=0)
    assert payload.dtype == torch.float32 and payload.shape == (k,)
    assert rk.payload_bytes(n) == 4 * k
    assert rk.decompress(payload, ctx).shape == g.shape


def test_decompress_keeps_shape_and_dtype():
    g = torch.randn(3, 4, 5, generator=_gen(1)).to(torch.bfloat16)
    for comp in (TopKCompressor(0.1), RandomKCompressor(0.1), DGCCompressor(0.1)):
        out = comp.decompress(*comp.compress(g, key=3))
        assert out.shape == g.shape and out.dtype == torch.bfloat16


# ---- top-k ----------------------------------------------------------------------------------------

def test_topk_picks_the_true_largest_magnitudes():
    g = torch.randn(1000, generator=_gen(2))
    comp = TopKCompressor(density=0.02, error_feedback=False)
    out = comp.decompress(*comp.compress(g, key=0))
    expected = torch.zeros_like(g)
    idx = g.abs().topk(20).indices
    expected[idx] = g[idx]
    assert torch.equal(out, expected)


def test_topk_error_feedback_sends_the_residual_later():
    comp = TopKCompressor(density=0.5)
    g = torch.tensor([4.0, -3.0, 1.0, 0.5])
    assert comp.decompress(*comp.compress(g, 0)).tolist() == [4.0, -3.0, 0.0, 0.0]
    # residual [0, 0, 1, 0.5] is added: [4, -3, 2, 1] -> sends 4, -3 again; residual [0, 0, 2, 1]
    comp.compress(g, 0)
    assert comp.decompress(*comp.compress(torch.zeros(4), 0)).tolist() == [0.0, 0.0, 2.0, 1.0]


# ---- random-k -------------------------------------------------------------------------------------

def test_randomk_indices_agree_across_ranks_and_differ_across_keys_and_steps():
    ranks = [RandomKCompressor(density=0.05, seed=7) for _ in range(3)]
    grads = [torch.randn(500, generator=_gen(r)) for r in range(3)]
    seen = []
    for _step in range(3):
        for key in (0, 1):
            ctxs = [comp.compress(g, key)[1] for comp, g in zip(ranks, grads, strict=True)]
            assert all(torch.equal(ctx[0], ctxs[0][0]) for ctx in ctxs)
            assert ctxs[0][0].unique().numel() == 25
            seen.append(ctxs[0][0])
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:])
    other_seed = RandomKCompressor(density=0.05, seed=8).compress(grads[0], 0)[1][0]
    assert not torch.equal(other_seed, seen[0])


def test_randomk_payloads_sum_like_an_all_reduce():
    ranks = [RandomKCompressor(density=0.1, error_feedback=False) for _ in range(3)]
    grads = [torch.randn(200, generator=_gen(10 + r)) for r in range(3)]
    outs = [comp.compress(g, 0) for comp, g in zip(ranks, grads, strict=True)]
    summed = ranks[0].decompress(sum(p for p, _ in outs), outs[0][1])
    separately = sum(comp.decompress(p, ctx) for comp, (p, ctx) in zip(ranks, outs, strict=True))
    torch.testing.assert_close(summed, separately)
    mask = summed != 0
    torch.testing.assert_close(summed[mask], sum(grads)[mask])
    assert mask.sum() == 20


# ---- error feedback over many steps --------------------------------------------------------------

def _track(comp, steps=200, n=100, ranks=1):
    """Residual norms |sum of true gradients - sum of decompressed payloads| per step, for `ranks`
    copies of `comp` all-gathering (or all-reducing) their payloads."""
    comps = [comp() for _ in range(ranks)]
    gen = _gen(123)
    true, sent, norms = torch.zeros(n), torch.zeros(n), []
    for _ in range(steps):
        grads = [torch.randn(n, generator=gen) for _ in range(ranks)]
        outs = [c.compress(g, key=5) for c, g in zip(comps, grads, strict=True)]
        if comps[0].summable:
            got = comps[0].decompress(sum(p for p, _ in outs), outs[0][1])
        else:
            got = sum(c.decompress(p, ctx) for c, (p, ctx) in zip(comps, outs, strict=True))
        true += sum(grads)
        sent += got
        norms.append(float((true - sent).norm()))
    return norms, true, sent, comps


@pytest.mark.parametrize("make", [
    lambda: TopKCompressor(density=0.1),
    lambda: RandomKCompressor(density=0.1),
    lambda: DGCCompressor(density=0.1, momentum=0.0),
], ids=["topk", "randomk", "dgc_no_momentum"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_error_feedback_residual_stays_bounded(make, ranks):
    norms, true, sent, comps = _track(make, ranks=ranks)
    # the residual is exactly what the compressors still hold back
    held = sum((c.memory.residual[5] if hasattr(c, "memory") else c.v[5]) for c in comps)
    torch.testing.assert_close(true - sent, held, atol=1e-3, rtol=1e-4)
    early, late = max(norms[50:100]), max(norms[150:200])
    assert late < 1.5 * early, (early, late)
    # far below the random walk of the true sum (~ sqrt(200 * n * ranks))
    assert max(norms) < 0.5 * float(true.norm()) + 0.5 * math.sqrt(200 * 100 * ranks)


def test_without_error_feedback_the_residual_grows():
    norms, *_ = _track(lambda: TopKCompressor(density=0.1, error_feedback=False))
    assert max(norms[150:200]) > 1.5 * max(norms[25:50])


def test_dgc_with_momentum_sends_every_coordinate_eventually():
    comp = DGCCompressor(density=0.05, momentum=0.9)
    gen = _gen(4)
    ever = torch.zeros(1000, dtype=torch.bool)
    for _ in range(200):
        out = comp.decompress(*comp.compress(torch.randn(1000, generator=gen) * 0.1 + 0.01, key=0))
        ever |= out != 0
    assert ever.all()
    assert comp.u[0].abs().max() < 10 and comp.v[0].abs().max() < 100  # masking keeps the state bounded


# ---- DGC details ---------------------------------------------------------------------------------

def test_dgc_warmup_density_schedule():
    comp = DGCCompressor(density=0.001, warmup_steps=4)
    assert [comp.density_at(s) for s in range(6)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert [DGCCompressor(density=0.1, warmup_steps=4).density_at(s) for s in range(5)] == [0.25] * 4 + [0.1]
    spread = DGCCompressor(density=0.001, warmup_steps=40)  # four stages of ten calls each
    assert [spread.density_at(s) for s in (0, 9, 10, 29, 30, 39, 40)] == [
        0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001]
    assert DGCCompressor(density=0.01).density_at(0) == 0.01
    g = torch.randn(1000, generator=_gen(5))
    sizes = [comp.compress(g, key=1)[0].numel() for _ in range(6)]
    assert sizes == [8 * 250, 8 * 63, 8 * 16, 8 * 4, 8 * 1, 8 * 1]


def test_dgc_sampled_threshold_selects_about_k():
    v = torch.randn(100_000, generator=_gen(6))
    for density in (0.001, 0.01):
        comp = DGCCompressor(density=density, sample_fraction=0.01)
        k = math.ceil(density * v.numel())
        thresholds = set()
        for call in range(5):
            threshold = comp.threshold(v.abs(), k, key=3, call=call)
            thresholds.add(float(threshold))
            selected = int((v.abs() >= threshold).sum())
            assert k / 2 <= selected <= 2 * k, (density, k, selected)
        assert len(thresholds) > 1  # each call samples afresh
        assert comp.threshold(v.abs(), k, key=3, call=2) == comp.threshold(v.abs(), k, key=3, call=2)
        chosen, keep = comp.select(v, k)
        assert chosen.numel() == k
        sent = chosen[keep]
        assert sent.unique().numel() == sent.numel()
        # what is chosen are large entries: all above the true 2k-th largest magnitude
        assert v.abs()[sent].min() >= v.abs().topk(2 * k).values.min()


@pytest.mark.parametrize("threshold", [None, 0.5, 2.5], ids=["sampled", "more_than_k", "fewer_than_k"])
def test_dgc_fixed_size_selection_equals_the_cpu_one(monkeypatch, threshold):
    """Off the CPU, DGC selects through a masked top-k in fixed sizes (no host read): the same
    entries sent, the same momenta masked, call after call."""
    import paraloom.compress.dgc as dgc

    def run(fixed):
        monkeypatch.setattr(dgc, "fixed_size", lambda device: fixed)
        comp = DGCCompressor(density=0.01, momentum=0.9)
        if threshold is not None:
            comp.threshold = lambda magnitudes, k, key, call: torch.tensor(threshold)
        outs = []
        for step in range(4):
            g = torch.randn(5000, generator=_gen(10 + step))
            outs.append(comp.decompress(*comp.compress(g, key=2)))
        return outs, comp.u[2], comp.v[2]

    (cpu, u_cpu, v_cpu), (fixed, u_fixed, v_fixed) = run(False), run(True)
    for a, b in zip(cpu, fixed, strict=True):
        assert torch.equal(a, b)
        assert 0 < int((a != 0).sum()) <= 50
    assert torch.equal(u_cpu, u_fixed) and torch.equal(v_cpu, v_fixed)


def test_dgc_clips_the_local_gradient():
    comp = DGCCompressor(density=1.0, momentum=0.0, clip_norm=1.0)
    out = comp.decompress(*comp.compress(torch.tensor([3.0, 4.0]), key=0))
    torch.testing.assert_close(out, torch.tensor([0.6, 0.8]))


def test_dgc_pads_a_short_selection_with_zero_values():
    comp = DGCCompressor(density=0.5, momentum=0.0)
    g = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0])
    comp.threshold = lambda magnitudes, k, key, call: torch.tensor(1.0)  # selects fewer than k
    payload, ctx = comp.compress(g, 0)
    assert payload.numel() == 8 * 3
    assert comp.decompress(payload, ctx).tolist() == [0.0, 0.0, 5.0, 0.0, 0.0, 0.0]


# ---- PowerSGD ------------------------------------------------------------------------------------

def _powersgd_round(states, grads, key=0):
    """One PowerSGD step for simulated ranks: the all-reduces are sums over the list."""
    p_sum = sum(s.p_matrices(key, g) for s, g in zip(states, grads, strict=True))
    q_sum = sum(s.q_matrices(key, p_sum) for s in states)
    outs = [s.decompress(key, q_sum, grads[0].shape) for s in states]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    return outs[0]


def test_orthogonalize_gives_orthonormal_columns():
    q = orthogonalize(torch.randn(50, 4, generator=_gen(7)))
    torch.testing.assert_close(q.T @ q, torch.eye(4), atol=1e-5, rtol=0)
    z = orthogonalize(torch.zeros(5, 2))
    assert torch.isfinite(z).all() and z.abs().sum() == 0


def test_powersgd_shapes_and_should_compress_rules():
    state = PowerSGDState(rank=2, start_iter=3)
    assert not state.should_compress((64, 32))  # before start_iter
    for _ in range(3):
        state.next_iteration()
    assert state.should_compress((64, 32))
    assert state.should_compress((16, 3, 3, 3))  # conv kernel as 16 x 27
    assert not state.should_compress((1000,))
    assert not state.should_compress((4, 4))  # 2 * (4 + 4) >= 16: no shrinking
    assert not state.should_compress((1, 100))
    assert state.should_compress((5, 5))  # 2 * 10 < 25
    g = torch.randn(16, 3, 3, 3, generator=_gen(8))
    p = state.p_matrices(0, g)
    assert p.shape == (16, 2)
    q = state.q_matrices(0, p)
    assert q.shape == (27, 2)
    assert state.payload_elements(g.shape) == (32, 54)
    assert state.decompress(0, q, g.shape).shape == g.shape


def test_powersgd_is_exact_for_a_low_rank_matrix():
    gen = _gen(9)
    m = torch.randn(40, 3, generator=gen) @ torch.randn(3, 30, generator=gen)
    state = PowerSGDState(rank=3, start_iter=0)
    errors = [float((_powersgd_round([state], [m]) - m).norm() / m.norm()) for _ in range(5)]
    assert errors[-1] < 1e-4 and max(errors) < 1e-3
    assert state.errors[0].norm() < 1e-3 * m.norm()


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    gen = _gen(10)
    u, _ = torch.linalg.qr(torch.randn(30, 20, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen))
    s = torch.tensor([10.0, 6.0] + [2.0 / (i + 1) for i in range(18)])
    m = (u * s) @ v.T
    best = (u[:, :2] * s[:2]) @ v[:, :2].T
    state = PowerSGDState(rank=2, start_iter=0, error_feedback=False)
    for _ in range(20):  # power iteration through the warm-started Q: error ~ (2 / 6) ** (2 * steps)
        out = _powersgd_round([state], [m])
    torch.testing.assert_close(out, best, atol=1e-3, rtol=1e-3)


def test_powersgd_error_feedback_keeps_the_running_sum_close():
    gen = _gen(11)
    state = PowerSGDState(rank=1, start_iter=0)
    true, sent, norms = torch.zeros(20, 10), torch.zeros(20, 10), []
    for _ in range(200):
        g = torch.randn(20, 10, generator=gen)
        true += g
        sent += _powersgd_round([state], [g])
        torch.testing.assert_close(true - sent, state.errors[0], atol=1e-3, rtol=1e-4)
        norms.append(float((true - sent).norm()))
    assert max(norms[150:]) < 1.5 * max(norms[50:100])


@pytest.mark.parametrize("identical", [True, False])
def test_powersgd_three_simulated_ranks_equal_compressing_the_sum(identical):
    gen = _gen(12)
    ranks = [PowerSGDState(rank=2, start_iter=0, seed=3) for _ in range(3)]
    single = PowerSGDState(rank=2, start_iter=0, seed=3)
    for _ in range(5):
        base = torch.randn(12, 9, generator=gen)
        grads = [base.clone() for _ in range(3)] if identical else \
            [torch.randn(12, 9, generator=gen) for _ in range(3)]
        torch.testing.assert_close(_powersgd_round(ranks, grads), _powersgd_round([single], [sum(grads)]),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sum(s.errors[0] for s in ranks), single.errors[0], atol=1e-4, rtol=1e-4)


def test_powersgd_without_warm_start_draws_the_same_q_on_every_rank():
    a, b = PowerSGDState(rank=2, start_iter=0, warm_start=False), PowerSGDState(rank=2, start_iter=0,
                                                                             warm_start=False)
    g = torch.randn(10, 8, generator=_gen(13))
    first = [a.p_matrices(0, g), b.p_matrices(0, g)]
    assert torch.equal(*first)
    a.q_matrices(0, first[0])
    a.decompress(0, torch.zeros(8, 2))
    assert not torch.equal(a.p_matrices(0, g), first[0])  # a new Q each step


# ---- multi-process: all-gathered top-k ------------------------------------------------------------

SIZES = [0, 1, 7, 1000]


def _gather_topk(rank, world):
    comp = TopKCompressor(density=0.05)
    results = []
    for n in SIZES:
        g = torch.randn(n, generator=_gen(100 * rank + n))
        own = []
        for step in range(3):
            payload, ctx = comp.compress(g, key=n)
            own.append(comp.decompress(payload, ctx))
            gathered = torch.empty(world * payload.numel(), dtype=torch.uint8)
            dist.all_gather_into_tensor(gathered, payload)
            parts = gathered.view(world, -1) if payload.numel() else [payload] * world
            total = sum(comp.decompress(part, ctx) for part in parts)
            results.append((n, step, own[-1], total))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_gathered_topk_sums_to_the_ranks_own_decompressions(world):
    results = run_workers(_gather_topk, world)
    for i, (n, _step, _, total) in enumerate(results[0]):
        expected = sum(r[i][2] for r in results)
        assert total.shape == (n,)
        torch.testing.assert_close(total, expected, rtol=0, atol=0)
        for r in results[1:]:
            torch.testing.assert_close(r[i][3], total, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_decompress_sum_equals_the_sum_of_decompressions(name):
    from paraloom.compress.base import make_compressor

    comps = [make_compressor(name, density=0.05) for _ in range(3)]
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    payloads = [c.compress(x, key=0) for c, x in zip(comps, xs, strict=True)]
    expected = sum(comps[0].decompress(p, ctx) for p, ctx in payloads)
    out = torch.empty(1000)
    comps[0].decompress_sum(torch.stack([p for p, _ in payloads]), payloads[0][1], out)
    torch.testing.assert_close(out, expected)


def test_dgc_loads_a_checkpoint_written_with_its_old_generator_state():
    """Before the sample was drawn per (seed, key, call), DGC's state held a generator's state."""
    from paraloom.compress.state import load_state_of, state_dict_of

    comp = DGCCompressor(density=0.01)
    comp.compress(torch.randn(1000, generator=_gen(3)), key=0)
    old = {**state_dict_of(comp), "generator": torch.Generator().get_state()}
    fresh = DGCCompressor(density=0.01)
    load_state_of(fresh, old)
    assert fresh.calls == comp.calls and torch.equal(fresh.v[0], comp.v[0])
