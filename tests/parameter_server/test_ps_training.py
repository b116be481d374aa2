"""The parameter-server trainer on digits: BSP equals all-reduce training; ASP and SSP converge like it."""

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.errors import UserError
from paraloom.parameter_server.train import train_ps
from paraloom.train.trainer import train

torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


def _cfg(*sets):
    return load_config(None, ["model.name=mlp", "model.hidden=64", "run.checkpoint_every=0", *sets])


def _job(rank, world, cfg, ps):
    fn = train_ps if ps else train
    summary = fn(cfg, None, device=torch.device("cpu"))
    return summary


def _trained_params(rank, world, cfg, ps):
    """The summary, and the parameters the run evaluates at its end (captured at evaluation)."""
    import importlib

    module = importlib.import_module("paraloom.parameter_server.train" if ps else "paraloom.train.trainer")
    captured, original = {}, module.evaluate

    def grab(model, split, groups):
        captured["params"] = [p.detach().clone() for p in model.parameters()]
        return original(model, split, groups)

    module.evaluate = grab
    summary = (train_ps if ps else train)(cfg, None, device=torch.device("cpu"))
    return summary, captured.get("params")


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_bsp_training_equals_all_reduce_training(optim):
    cfg = _cfg("optim.epochs=2", f"optim.name={optim}", "parallel.mode=ps", "ps.servers=2")
    ps = run_workers(_trained_params, 4, cfg, True, timeout=120)  # 2 workers, 2 servers
    dp = run_workers(_trained_params, 2, _cfg("optim.epochs=2", f"optim.name={optim}", "guard.nan=false"),
                     False, timeout=120)
    for a, b in zip(ps[0][1], dp[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert ps[0][0]["test_accuracy"] == pytest.approx(dp[0][0]["test_accuracy"], abs=0.003)


def test_asp_and_ssp_reach_bsp_accuracy_within_one_point():
    accuracy = {}
    for name, sets in {"bsp": ["ps.consistency=bsp"], "asp": ["ps.consistency=asp"],
                       "ssp1": ["ps.consistency=ssp", "ps.staleness=1"],
                       "ssp3": ["ps.consistency=ssp", "ps.staleness=3"]}.items():
        cfg = _cfg("parallel.mode=ps", "data.batch_size=64", *sets)
        out = run_workers(_job, 5, cfg, True, timeout=180)  # 4 workers, 1 server
        accuracy[name] = out[0]["test_accuracy"]
    for name in ("asp", "ssp1", "ssp3"):
        assert accuracy[name] >= accuracy["bsp"] - 0.01, accuracy


def test_ps_mode_refuses_what_it_does_not_do_yet():
    with pytest.raises(UserError, match="does not compress pushes yet"):
        _cfg("parallel.mode=ps", "comm.compressor=topk")
    with pytest.raises(UserError, match="ps.servers=0 must be at least 1"):
        _cfg("parallel.mode=ps", "ps.servers=0")
