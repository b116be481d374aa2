"""A parameter-server checkpoint resumes on another number of servers and workers: the servers' state is
the saved one, cut again; BSP then goes on as the straight run does; the clocks restart at the cut."""

import pytest
import torch

from paraloom.errors import UserError
from paraloom.parameter_server.resplit import recut
from paraloom.parameter_server.server import ParameterServer


def _sgd_momentum(params):
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    optimizer.param_groups[0]["updates"] = 0  # as server_optimizer's schedule count
    return optimizer


def _stepped_slice(values, steps, *, pushes):
    piece = ParameterServer(torch.tensor(values), _sgd_momentum, workers=[0, 1], bound=None, average=False)
    for _ in range(steps):
        piece.param.grad.copy_(piece.param.detach() * 0.5 + 1)
        piece.step()
        piece.optimizer.param_groups[0]["updates"] += 1
    piece.clocks, piece.pushes_applied, piece.received = {0: 3, 1: 3}, pushes, {0: 3, 1: 3}
    return piece.state_dict()


def test_recut_joins_elementwise_state_and_takes_the_rest_from_the_first_elements_slice():
    """Two saved slices of 3 and 2 elements onto three of 1, 3 and 1; 2 ASP workers become 3."""
    saved = [_stepped_slice([1.0, 2.0, 3.0], 6, pushes=6), _stepped_slice([4.0, 5.0], 4, pushes=4)]
    whole = torch.cat([s["param"] for s in saved])
    momentum = torch.cat([s["optimizer"]["state"][0]["momentum_buffer"] for s in saved])
    states = recut(saved, [(0, 1), (1, 4), (4, 5)], n_params=5, workers=[0, 1, 2], clock=3,
                   updates_scale=(3, 2))
    assert torch.equal(torch.cat([s["param"] for s in states]), whole)
    assert torch.equal(torch.cat([s["optimizer"]["state"][0]["momentum_buffer"] for s in states]), momentum)
    assert [s["version"] for s in states] == [6, 6, 4]  # the saved slice holding each first element
    assert [s["pushes_applied"] for s in states] == [6, 6, 4]
    assert [s["optimizer"]["param_groups"][0]["updates"] for s in states] == [9, 9, 6]  # per 3 workers
    assert all(s["clocks"] == {0: 3, 1: 3, 2: 3} and s["received"] == {0: 3, 1: 3, 2: 0} for s in states)
    fresh = ParameterServer(torch.zeros(3), _sgd_momentum, workers=[0, 1, 2], bound=None, average=False)
    fresh.load_state_dict(states[1])  # loads as a slice of 3 elements and 3 workers
    assert torch.equal(fresh.param.detach(), whole[1:4])
    with pytest.raises(UserError, match="hold 5 parameters; this model has 6"):
        recut(saved, [(0, 6)], n_params=6, workers=[0], clock=3)
