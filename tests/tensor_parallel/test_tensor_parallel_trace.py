"""trace_tensor_parallel: every tensor-parallel collective, forward and backward, becomes a "tp" span."""

import copy
from collections import Counter

import torch
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_loss,
    trace_tensor_parallel,
)
from paraloom.trace.timeline import Timeline

VOCAB, WIDTH, HIDDEN, BATCH, SEQ = 16, 8, 12, 2, 3


class TinyLM(nn.Module):
    """Embedding, a column -> row MLP, a gathered column into a scattering row, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = VocabParallelEmbedding.from_embedding(nn.Embedding(VOCAB, WIDTH))
        self.fc = ColumnParallelLinear.from_linear(nn.Linear(WIDTH, HIDDEN))
        self.proj = RowParallelLinear.from_linear(nn.Linear(HIDDEN, WIDTH))
        self.gathered = ColumnParallelLinear.from_linear(nn.Linear(WIDTH, WIDTH), gather_output=True)
        self.scattered = RowParallelLinear.from_linear(nn.Linear(WIDTH, WIDTH), input_is_parallel=False)
        self.head = ColumnParallelLinear.from_linear(nn.Linear(WIDTH, VOCAB))  # vocabulary-parallel logits

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.proj(torch.relu(self.fc(h)))
        return self.head(self.scattered(self.gathered(h)))


def _run(model, ids, targets, timeline=None):
    logits = model(ids)
    loss = tp_loss(logits, targets, timeline=timeline)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach(), loss.detach(), grads


def _traced(rank, world):
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ),
                                                                                      generator=g)
    model = TinyLM()
    plain = _run(copy.deepcopy(model), ids, targets)  # never traced
    timeline = Timeline(rank)
    layers = trace_tensor_parallel(model, timeline)
    _run(model, ids, targets, timeline)  # inactive: records nothing
    assert timeline.to_chrome()["traceEvents"][2:] == []
    timeline.active = True
    traced = _run(model, ids, targets, timeline)
    timeline.active = False
    assert trace_tensor_parallel(model, None) == layers and model.fc.timeline is None
    events = [e for e in timeline.to_chrome()["traceEvents"] if e["ph"] == "X"]
    return layers, plain, traced, events


def test_collectives_of_both_directions_are_traced_and_change_nothing():
    for rank, (layers, plain, traced, events) in enumerate(run_workers(_traced, 2)):
        assert layers == 6
        assert_close(traced[0], plain[0], rtol=0, atol=0)
        assert_close(traced[1], plain[1], rtol=0, atol=0)
        assert_close(traced[2], plain[2], rtol=0, atol=0)
        assert {e["cat"] for e in events} == {"tp"}
        assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in events)
        assert Counter(e["name"] for e in events) == {
            "all_reduce g forward": 3,  # emb, proj, scattered
            "all_reduce f backward": 3,  # the inputs of fc, gathered, head
            "all_gather forward": 1,  # gathered
            "all_gather backward": 1,  # scattered
            "all_reduce max cross_entropy forward": 1,
            "all_reduce sum cross_entropy forward": 1,
        }, rank
        by_name = {e["name"]: e for e in events}
        half = BATCH * SEQ * WIDTH // 2 * 4  # float32 bytes this rank hands to the all-gather
        assert by_name["all_gather forward"]["args"]["bytes"] == half
        first_backward = min(e["ts"] for e in events if e["name"].endswith("backward"))
        assert all(e["ts"] < first_backward for e in events if e["name"].endswith("forward"))
