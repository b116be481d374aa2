"""A traced PipelineStage records compute, sends and waits per micro-batch; untraced: nothing, same math."""

import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn

from paraloom.pipeline_parallel import PipelineStage, balance_by_params, split_microbatches, stage_module
from paraloom.trace.timeline import Timeline

M, BATCH = 3, 6


class Sleep(nn.Module):
    """Holds a stage up for `seconds` per micro-batch, so its neighbour's sends wait for it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 2))


def spans(timeline):
    return [e for e in timeline.to_chrome()["traceEvents"] if e["ph"] == "X"]


def _stage(rank, world, schedule, static_shapes, delay=0.0):
    model = make_model()
    module = stage_module(model, balance_by_params(model, world), rank)
    if delay and rank == world - 1:
        module.insert(0, Sleep(delay))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)
    inputs = split_microbatches(x, M) if rank == 0 else None
    targets = split_microbatches(y, M) if rank == world - 1 else None
    timeline = Timeline(rank)
    # the constructor takes a timeline; the attribute set later works alike
    stage = PipelineStage(module, loss_fn=F.mse_loss, static_shapes=static_shapes,
                          timeline=timeline if rank % 2 else None)
    stage.timeline = timeline

    def step():
        loss, _ = stage.step(schedule, inputs, targets, n_microbatches=M, broadcast_loss=True)
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        return loss.item(), grads

    inactive = step()
    assert spans(timeline) == []  # a timeline that is not active records nothing
    timeline.active = True
    traced = step()
    timeline.active = False
    stage.timeline = None
    untraced = step()
    return inactive, traced, untraced, spans(timeline)


def expected_sends(rank, world):
    sends = []
    if rank < world - 1:
        sends += [f"send F{i} to stage {rank + 1}" for i in range(M)]
    if rank > 0:
        sends += [f"send B{i} to stage {rank - 1}" for i in range(M)]
    return sorted(sends)


@pytest.mark.parametrize(("world", "schedule", "static_shapes"), [
    (2, "gpipe", False), (2, "1f1b", True), (3, "gpipe", True), (3, "1f1b", False)])
def test_each_stage_records_its_compute_sends_and_waits(world, schedule, static_shapes):
    results = run_workers(_stage, world, schedule, static_shapes)
    for rank, (inactive, traced, untraced, events) in enumerate(results):
        for other in (inactive, traced):  # tracing changes no number
            torch.testing.assert_close(other[0], untraced[0], rtol=0, atol=0)
            torch.testing.assert_close(other[1], untraced[1], rtol=0, atol=0)
        assert all(e["dur"] >= 0 and e["args"]["stage"] == rank for e in events)
        lanes = Counter(e["cat"] for e in events)
        assert set(lanes) == {"compute", "p2p"}, lanes
        compute = sorted(e["name"] for e in events if e["cat"] == "compute")
        assert compute == sorted([f"F{i}" for i in range(M)] + [f"B{i}" for i in range(M)])
        sends = sorted(e["name"] for e in events if e["name"].startswith("send"))
        assert sends == expected_sends(rank, world), (rank, sends)
        waits = {e["name"] for e in events if e["name"].startswith("wait")}
        may_wait = {f"wait F{i}" for i in range(M) if rank > 0} | {f"wait B{i}" for i in range(M)
                                                                 if rank < world - 1}
        assert waits <= may_wait, (rank, waits)
        by_name = {e["name"]: e for e in events}
        for i in range(M):
            forward, backward = by_name[f"F{i}"], by_name[f"B{i}"]
            assert forward["args"]["microbatch"] == i
            assert forward["ts"] + forward["dur"] <= backward["ts"]
            if rank < world - 1:
                send = by_name[f"send F{i} to stage {rank + 1}"]
                assert send["ts"] >= forward["ts"] + forward["dur"]
                assert send["args"]["bytes"] == BATCH // M * 8 * 4  # float32 activations of width 8


def test_a_send_ends_when_the_next_stage_takes_it():
    """Stage 1 sleeps 30 ms in each forward and, learning shapes from headers, posts micro-batch 1's
    receive only after its F0: stage 0's send F1 lasts that long, and ends when stage 1 takes it, not
    when the step's final wait would see it (after stage 0's backwards)."""
    (*_, first), _ = run_workers(_stage, 2, "gpipe", False, delay=0.03)
    send = next(e for e in first if e["name"] == "send F1 to stage 1")
    first_backward = min(e["ts"] for e in first if e["name"].startswith("B"))
    assert send["dur"] >= 20e3  # microseconds
    assert send["ts"] + send["dur"] < first_backward - 20e3  # stage 1 still had F2 to run
