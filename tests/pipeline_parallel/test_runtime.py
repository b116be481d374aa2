"""PipelineStage equals one process training the whole GPT on the whole batch, for any schedule."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers

from paraloom.config.errors import UserError
from paraloom.data_parallel import DataParallel
from paraloom.models.gpt import GPT
from paraloom.pipeline_parallel import (
    Chunks,
    PipelineStage,
    balance_by_params,
    make_schedule,
    split_microbatches,
    stage_module,
)
from paraloom.pipeline_parallel.stages import bubbles
from paraloom.topology import Topology

STEPS, BATCH, SEQ, VOCAB = 5, 8, 16, 256


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_gpt():
    torch.manual_seed(0)
    return GPT((SEQ,), VOCAB, n_layers=4, d_model=32, n_heads=4)


def make_optimizer(name, params):
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def data():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g))


def reference(opt_name):
    """One process, whole model, whole batch."""
    gpt = make_gpt()
    opt = make_optimizer(opt_name, gpt.parameters())
    x, y = data()
    losses = []
    for t in range(STEPS):
        loss = lm_loss(gpt(x[t]), y[t])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in gpt.parameters()]


def _pipeline(rank, world, schedule, m, opt_name, static_shapes=False):
    gpt = make_gpt()  # every rank builds the whole model with one seed and keeps its slice
    module = stage_module(gpt, balance_by_params(gpt, world), rank)
    opt = make_optimizer(opt_name, module.parameters())
    stage = PipelineStage(module, loss_fn=lm_loss, static_shapes=static_shapes)
    x, y = data()
    losses, bubbles = [], []
    for t in range(STEPS):
        inputs = split_microbatches(x[t], m) if stage.is_first else None
        targets = split_microbatches(y[t], m) if stage.is_last else None
        actions = schedule if isinstance(schedule, str) else schedule[rank]
        loss, stats = stage.step(actions, inputs, targets, n_microbatches=m, broadcast_loss=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        bubbles.append(stats.bubble)
    return losses, [p.detach().clone() for p in module.parameters()], bubbles


def check(results, ref):
    ref_losses, ref_params = ref
    params = []
    for losses, stage_params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        params += stage_params
    torch.testing.assert_close(params, ref_params)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4])
def test_equals_one_process(p, schedule, m):
    results = run_workers(_pipeline, p, schedule, m, "sgd")
    check(results, reference("sgd"))
    for *_, shares in results:
        assert all(0 <= b < 1 for b in shares)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_layers_is_model_parallelism(p):
    assert make_schedule("layers", p, 1) == make_schedule("gpipe", p, 1)
    check(run_workers(_pipeline, p, "layers", 1, "sgd"), reference("sgd"))


def test_adam():
    check(run_workers(_pipeline, 4, "1f1b", 4, "adam"), reference("adam"))


def test_unequal_microbatches():
    check(run_workers(_pipeline, 2, "1f1b", 3, "sgd"), reference("sgd"))  # sizes 3, 3, 2


def test_any_feasible_action_lists():
    """One runtime executes any valid schedule, not only the registered ones."""
    schedule = [["F0", "F1", "B1", "B0"], ["F1", "F0", "B0", "B1"]]
    check(run_workers(_pipeline, 2, schedule, 2, "sgd"), reference("sgd"))


def _dp_pp(rank, world, schedule, m):
    groups = Topology(dp=2, pp=2).init_groups()
    gpt = make_gpt()
    module = stage_module(gpt, balance_by_params(gpt, 2), groups.pp_rank)
    engine = DataParallel(module, group=groups.dp_group)
    opt = make_optimizer("sgd", module.parameters())
    stage = PipelineStage(engine, pp_group=groups.pp_group, loss_fn=lm_loss)
    x, y = data()
    half = slice(groups.dp_rank * BATCH // 2, (groups.dp_rank + 1) * BATCH // 2)
    losses = []
    for t in range(STEPS):
        loss, _ = stage.step(schedule, split_microbatches(x[t][half], m), split_microbatches(y[t][half], m),
                             n_microbatches=m, no_sync=engine.no_sync, broadcast_loss=True)
        engine.step(opt)
        dist.all_reduce(loss, group=groups.dp_group)
        losses.append(loss.item() / 2)
    engine.close()
    return groups.pp_rank, groups.dp_rank, losses, [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dp2_pp2_equals_one_process(schedule):
    ref_losses, ref_params = reference("sgd")
    results = run_workers(_dp_pp, 4, schedule, 2)
    for dp_rank in range(2):
        stages = sorted((pp, params) for pp, dp, _, params in results if dp == dp_rank)
        torch.testing.assert_close([p for _, params in stages for p in params], ref_params)
    for *_, losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))


def _peaks(rank, world, m):
    gpt = make_gpt()
    stage = PipelineStage(stage_module(gpt, balance_by_params(gpt, world), rank), loss_fn=lm_loss)
    x, y = data()
    peaks = {}
    for name in ("gpipe", "1f1b"):
        _, stats = stage.step(name, split_microbatches(x[0], m), split_microbatches(y[0], m))
        peaks[name] = stats.peak_activation_bytes
    return peaks


def test_1f1b_holds_fewer_activations_than_gpipe():
    first, last = run_workers(_peaks, 2, 8)
    # stage 0 keeps all 8 micro-batches under GPipe, at most p - stage = 2 under 1F1B
    assert 0 < first["1f1b"] < first["gpipe"]
    assert first["1f1b"] == pytest.approx(first["gpipe"] * 2 / 8, rel=0.05)
    assert last["1f1b"] == pytest.approx(last["gpipe"] / 8, rel=0.05)  # the last stage: one at a time


def _missing_inputs(rank, world):
    if rank == 1:
        with pytest.raises(UserError, match="the last pipeline stage needs loss_fn="):
            PipelineStage(torch.nn.Linear(2, 2))
    stage = PipelineStage(stage_module(make_gpt(), [(0, 3), (3, 6)], rank), loss_fn=lm_loss)
    what = "inputs" if rank == 0 else "targets"
    with pytest.raises(UserError, match=f"needs {what}= with one tensor per micro-batch"):
        stage.step("gpipe", None, None, n_microbatches=2)
    with pytest.raises(UserError, match="B0 before F0"):
        stage.step(["B0", "F0"])
    return True


def test_errors_say_what_to_do():
    assert run_workers(_missing_inputs, 2) == [True, True]


@pytest.mark.parametrize(("p", "schedule"), [(2, "1f1b"), (4, "gpipe")])
def test_static_shapes_equal_one_process(p, schedule):
    """Headers only on the first step; later steps post receives with the learnt shapes."""
    check(run_workers(_pipeline, p, schedule, 4, "sgd", static_shapes=True), reference("sgd"))


def _changed_shape(rank, world):
    stage = PipelineStage(stage_module(make_gpt(), [(0, 3), (3, 6)], rank), loss_fn=lm_loss,
                          static_shapes=True)
    x, y = data()
    stage.step("gpipe", split_microbatches(x[0], 2), split_microbatches(y[0], 2))
    assert stage.sent_shapes if rank == 0 else stage.recv_shapes
    if rank == 0:  # the sender notices before anything is sent; the receiver sits this step out
        with pytest.raises(UserError, match="micro-batch 0's activation changed .* static_shapes=False"):
            stage.step("gpipe", split_microbatches(x[1][:6], 2), None)
    return True


def test_static_shapes_refuse_a_changed_shape():
    assert run_workers(_changed_shape, 2) == [True, True]


def _peaks_by_step(rank, world, static):
    stage = PipelineStage(stage_module(make_gpt(), [(0, 3), (3, 6)], rank), loss_fn=lm_loss,
                          static_shapes=static)
    x, y = data()
    steps = [stage.step("1f1b", split_microbatches(x[t], 4), split_microbatches(y[t], 4)) for t in range(3)]
    return [stats.peak_activation_bytes for _, stats in steps]


def test_static_shapes_measure_held_bytes_once_and_alike():
    static, measured = run_workers(_peaks_by_step, 2, True), run_workers(_peaks_by_step, 2, False)
    assert static == measured  # the first step's measurement stands for the later ones
    assert all(len(set(peaks)) == 1 and peaks[0] > 0 for peaks in static)


def _two_stages_in_a_row(rank, world):
    """Two PipelineStages on one group, one after the other, with static shapes: the first must
    leave no receive posted behind (a stray header receive once took the second's first header)."""
    losses = []
    for _ in range(2):
        gpt = make_gpt()
        module = stage_module(gpt, balance_by_params(gpt, world), rank)
        stage = PipelineStage(module, loss_fn=lm_loss if rank == world - 1 else None, static_shapes=True)
        x, y = data()
        for t in range(2):
            loss, _ = stage.step("1f1b", split_microbatches(x[t], 4) if rank == 0 else None,
                                 split_microbatches(y[t], 4) if rank == world - 1 else None,
                                 n_microbatches=4, broadcast_loss=True)
            losses.append(float(loss))
    return losses


def test_a_second_stage_on_the_same_group_runs_after_the_first():
    first, second = run_workers(_two_stages_in_a_row, 2, timeout=30)
    assert first == second and first[:2] == first[2:]  # the same model and data, the same losses


def _interleaved(rank, world, m, v, static_shapes, dp):
    """Interleaved 1F1B on p = world / dp stages of v chunks each (virtual stage c p + s), through
    the data-parallel engine when dp > 1; every rank's chunks' parameters by virtual stage."""
    groups = Topology(dp=dp, pp=world // dp).init_groups()
    p = world // dp
    gpt = make_gpt()
    bounds = balance_by_params(gpt, p * v)
    chunks = Chunks(stage_module(gpt, bounds, c * p + groups.pp_rank) for c in range(v))
    module = DataParallel(chunks, group=groups.dp_group) if dp > 1 else chunks
    opt = make_optimizer("sgd", chunks.parameters())
    stage = PipelineStage(module, pp_group=groups.pp_group, loss_fn=lm_loss, static_shapes=static_shapes,
                          virtual_stages=v)
    x, y = data()
    share = slice(groups.dp_rank * BATCH // dp, (groups.dp_rank + 1) * BATCH // dp)
    losses, outs = [], []
    for t in range(STEPS):
        inputs = split_microbatches(x[t][share], m) if stage.is_first else None
        targets = split_microbatches(y[t][share], m) if stage.is_last else None
        no_sync = module.no_sync if dp > 1 else None
        loss, stats = stage.step("interleaved_1f1b", inputs, targets, n_microbatches=m, no_sync=no_sync,
                                 broadcast_loss=True)
        if dp > 1:
            module.step(opt)
            dist.all_reduce(loss, group=groups.dp_group)
        else:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item() / dp)
        assert stats.n_microbatches == m and 0 <= stats.bubble < 1
    with torch.no_grad():  # forward only through the ring of chunks: the last stage gets the logits
        outs = stage.infer(x[0][share] if stage.is_first else None, module=chunks)
    if dp > 1:
        module.close()
    params = {c * p + groups.pp_rank: [q.detach().clone() for q in chunk.parameters()]
              for c, chunk in enumerate(chunks)}
    return groups.dp_rank, losses, params, outs


@pytest.mark.parametrize(("world", "m", "v", "static_shapes", "dp"), [
    (2, 2, 2, False, 1), (2, 4, 3, True, 1), (4, 2, 2, True, 2), (4, 4, 3, False, 2)],
    ids=["p2-m2-v2", "p2-m4-v3-static", "dp2xp2-m2-v2-static", "dp2xp2-m4-v3"])
def test_interleaved_equals_one_process(world, m, v, static_shapes, dp):
    ref_losses, ref_params = reference("sgd")
    results = run_workers(_interleaved, world, m, v, static_shapes, dp)
    for replica in range(dp):
        chunks = {}
        for dp_rank, losses, params, _ in results:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
            if dp_rank == replica:
                chunks.update(params)
        assert sorted(chunks) == list(range(len(chunks)))
        torch.testing.assert_close([q for u in sorted(chunks) for q in chunks[u]], ref_params)
    logits = [out for *_, out in results if out is not None]
    assert len(logits) == dp and logits[0].shape == (BATCH // dp, SEQ, VOCAB)


class Uneven(torch.nn.Module):
    """A stage module whose forward of micro-batch 1 (of 4 a step) takes `delay` seconds longer."""

    def __init__(self, module, delay):
        super().__init__()
        self.module, self.delay, self.calls = module, delay, 0

    def forward(self, x):
        self.calls += 1
        if self.calls % 4 == 2:
            time.sleep(self.delay)
        return self.module(x)


def _uneven(rank, world, delay):
    torch.set_num_threads(1)
    gpt = make_gpt()
    module = stage_module(gpt, balance_by_params(gpt, world), rank)
    stage = PipelineStage(Uneven(module, delay) if rank == 1 else module, loss_fn=lm_loss)
    x, y = data()
    stats = []
    for t in range(3):
        inputs = split_microbatches(x[t], 4) if stage.is_first else None
        targets = split_microbatches(y[t], 4) if stage.is_last else None
        stats.append(stage.step("1f1b", inputs, targets, n_microbatches=4)[1])
    listed = stage.step(stage.actions("1f1b", 4), inputs, targets)[1]  # a list: no named schedule
    return stats, listed


def test_steady_state_waits_are_told_apart_from_fill_and_drain():
    """Stage 1 forwards micro-batch 1 0.1 s late: stage 0 waits for B1's gradient where 1F1B has no
    idle (steady state), while its fill and drain waits (B0, B3) stay short."""
    (stage0, listed), (stage1, _) = run_workers(_uneven, 2, 0.1)
    for s in stage0:
        assert 0.08 <= s.steady_wait_seconds <= s.step_seconds - s.busy_seconds
    assert sorted(s.step_seconds - s.busy_seconds - s.steady_wait_seconds for s in stage0)[1] < 0.05
    # stage 1's own delays are its compute, not its waits (the median step: one stalled by a busy machine)
    assert sorted(s.steady_wait_seconds for s in stage1)[1] < 0.05
    assert listed.steady_wait_seconds == 0.0  # its own action list: every wait counts as fill and drain


def test_bubbles_split_the_bottleneck_stage():
    # rows: step, busy, schedule, steady-state wait; stage 1 computes most
    per_rank = torch.tensor([[1.0, 0.6, 1.0, 0.1], [1.0, 0.8, 0.9, 0.05]])
    figures = bubbles(per_rank, pp=2, m=8)
    assert figures["bubble_bottleneck"] == pytest.approx(0.2)
    assert figures["steady_wait_bottleneck"] == pytest.approx(0.05)
    assert figures["bubble_fill_drain"] == pytest.approx(0.15)
    assert figures["bubble_fill_drain_per_rank"] == pytest.approx([0.3, 0.15])
    assert figures["bubble_fill_drain_last_stage"] == pytest.approx(0.15)  # no stage column: the last row
    assert bubbles(per_rank[:, :3], pp=2, m=8)["bubble_fill_drain"] == pytest.approx(0.2)


def test_bubbles_read_step_by_step_cancel_a_steps_jitter():
    # one stage, three steps, each idle 0.1 of its schedule before marked actions; steps run long or
    # short and their waits fall in the steady state unevenly: the medians of each time, taken apart,
    # come from different steps and read 1 - (1.2 + 0.05) / 1.5; step by step every share is 0.1
    per_step = torch.tensor([[[0.9, 1.2, 1.3], [1.0, 2.0, 1.5], [0.0, 0.6, 0.05]]])
    per_rank = torch.tensor([[1.5, 1.2, 1.5, 0.05, 0.0]])
    assert bubbles(per_rank, pp=2, m=8)["bubble_fill_drain"] == pytest.approx(1 - 1.25 / 1.5)
    figures = bubbles(per_rank, pp=2, m=8, per_step=per_step)
    assert figures["bubble_fill_drain"] == pytest.approx(0.1)
    assert figures["makespan_seconds"] == pytest.approx(1.5)
    assert figures["steady_wait_bottleneck"] == pytest.approx(0.05 / 1.5)
    assert figures["bubble_per_rank"] == pytest.approx([1 - 1.3 / 1.5])  # of 0.1, 0.4 and 0.133


def test_fill_and_drain_are_read_against_the_first_stages_schedule():
    # stage 1's schedule (1.1 s) holds 0.1 s of waiting for what stage 0 does between steps beyond
    # its own: the makespan is stage 0's 1.0 s; the idle in all still reads against the longest
    per_rank = torch.tensor([[1.2, 0.80, 1.0, 0.05, 0.0], [1.2, 0.85, 1.1, 0.05, 1.0]])
    figures = bubbles(per_rank, pp=2, m=8)
    assert figures["makespan_seconds"] == pytest.approx(1.0)
    assert figures["bubble_fill_drain_per_rank"] == pytest.approx([0.15, 0.10])
    assert figures["bubble_fill_drain"] == pytest.approx(0.10)  # stage 1 computes most
    assert figures["bubble_fill_drain_last_stage"] == pytest.approx(0.10)
    assert figures["bubble_bottleneck"] == pytest.approx(1 - 0.85 / 1.1)
    # dp2 x pp2, stage 0 the busier: the bottleneck reads stage 0, the last stage the mean of its ranks
    grid = torch.tensor([[1.2, 0.90, 1.0, 0.02, 0.0], [1.2, 0.80, 1.0, 0.05, 1.0],
                         [1.2, 0.90, 1.0, 0.03, 0.0], [1.2, 0.80, 1.0, 0.07, 1.0]])
    figures = bubbles(grid, pp=2, m=8)
    assert figures["bubble_fill_drain"] == pytest.approx(0.08)
    assert figures["bubble_fill_drain_last_stage"] == pytest.approx(0.14)
