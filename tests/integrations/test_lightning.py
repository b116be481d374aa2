"""ParaloomStrategy and CommHookCallback under each Lightning package's own Trainer (`lightning.pytorch`
and the legacy `pytorch_lightning`): 2 CPU processes end where Lightning's DDPStrategy does."""

import importlib
import importlib.util
import os
import pickle
import socket
import sys
from pathlib import Path

import pytest
import torch
from scripts import run_command

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
INSTALLED = [name for name in PACKAGES if importlib.util.find_spec(name) is not None]
if not INSTALLED:
    pytest.skip("needs lightning: pip install paraloom[lightning]", allow_module_level=True)

SCRIPT = Path(__file__).with_name("lightning_digits.py")
# one launch per package: Lightning starts the second process at the first fit, the later fits reuse it
# 2 micro-batches a step (block_backward_sync), validation every 2 steps (Lightning zeroes the gradients
# to None before it validates, between the priority updater's step and its deferred update)
SAME = "accumulate=2,val_every=4"
FITS = {"ddp": f"ddp:{SAME}",
        "paraloom": f"paraloom:{SAME},scheduler=priority",
        "by-name": f"by-name:{SAME}",
        "compressed": "paraloom:steps=40,scheduler=priority,compressor=powersgd",
        "hook": "ddp:steps=40,hook=powersgd"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=INSTALLED)
def fits(request, tmp_path_factory) -> dict:
    """Every fit of FITS in one launch of the script under one package; rank 0's results by name."""
    out = tmp_path_factory.mktemp(request.param)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo"}
    run_command([sys.executable, str(SCRIPT), "--package", request.param, "--out", str(out), *FITS.values()],
                timeout=120, env=env)
    return dict(zip(FITS, torch.load(out / "results.pt", weights_only=True), strict=True))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("name", ["paraloom", "by-name"])
def test_paraloom_strategy_matches_ddp_strategy(fits, name):
    ours, theirs = fits[name], fits["ddp"]
    assert (ours["strategy"], theirs["strategy"]) == ("ParaloomStrategy", "DDPStrategy")
    assert ours["validated"] == theirs["validated"] > 0
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for key, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(ours["losses"], theirs["losses"])


def test_paraloom_strategy_with_priority_and_powersgd_trains(fits):
    # the priority updater applies the step itself: the strategy wraps the optimizer in DistributedOptimizer
    losses = fits["compressed"]["losses"]
    assert _mean(losses[-10:]) < 0.5 * _mean(losses[:10]), losses


def test_comm_hook_callback_compresses_lightning_ddp(fits):
    result = fits["hook"]
    assert _mean(result["losses"][-10:]) < 0.5 * _mean(result["losses"][:10]), result["losses"]
    fp32 = 40 * 4 * sum(value.numel() for value in result["state_dict"].values())
    assert 0 < result["hook_bytes"] < 0.5 * fp32  # plain for PowerSGD's 10 warm-up steps, then rank 2


@pytest.mark.parametrize("name", INSTALLED)
def test_each_package_gets_classes_of_its_own(name):
    from paraloom.integrations import lightning as bridge

    module = importlib.import_module(PACKAGES[name])
    found = bridge.for_package(name)
    assert found.package == PACKAGES[name]
    assert issubclass(found.ParaloomStrategy, module.strategies.DDPStrategy)
    assert issubclass(found.CommHookCallback, module.Callback)
    assert module.strategies.StrategyRegistry["paraloom"]["strategy"] is found.ParaloomStrategy
    # the classes pickle by name (a spawned Trainer pickles its strategy)
    strategy = pickle.loads(pickle.dumps(found.ParaloomStrategy(scheduler="priority")))
    assert type(strategy) is found.ParaloomStrategy and strategy._ddp_kwargs == {"scheduler": "priority"}
    default = "lightning.pytorch" if "lightning" in INSTALLED else "pytorch_lightning"
    assert bridge.PACKAGE == default
    assert bridge.ParaloomStrategy is bridge.for_package(default).ParaloomStrategy


def test_an_unknown_package_name_lists_the_known():
    from paraloom.integrations.lightning import for_package

    with pytest.raises(ValueError, match="choose one of: lightning, pytorch_lightning"):
        for_package("lightning_pytorch")


def _import_without(monkeypatch, *missing: str):
    """Import the bridge afresh as if the `missing` modules were not installed (after the real one,
    whose classes stay the ones registered)."""
    import paraloom.integrations
    import paraloom.integrations.lightning  # noqa: F401

    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "paraloom.integrations.lightning", raising=False)
    monkeypatch.setattr(paraloom.integrations, "lightning", None, raising=False)
    return importlib.import_module("paraloom.integrations.lightning")


@pytest.mark.skipif("pytorch_lightning" not in INSTALLED, reason="needs pytorch_lightning")
def test_without_lightning_the_legacy_package_is_the_default(monkeypatch):
    from paraloom.integrations import MissingExtra

    bridge = _import_without(monkeypatch, "lightning.pytorch")
    assert bridge.PACKAGE == "pytorch_lightning"
    legacy = importlib.import_module("pytorch_lightning")
    assert issubclass(bridge.ParaloomStrategy, legacy.strategies.DDPStrategy)
    missing = r'^lightning.pytorch is not installed: pip install "paraloom\[lightning\]"$'
    with pytest.raises(MissingExtra, match=missing):
        bridge.for_package("lightning")


def test_without_either_package_the_import_names_the_extra(monkeypatch):
    from paraloom.integrations import MissingExtra

    with pytest.raises(MissingExtra) as caught:
        _import_without(monkeypatch, "lightning.pytorch", "pytorch_lightning")
    assert isinstance(caught.value, ImportError)
    assert str(caught.value) == ('lightning (or the legacy pytorch_lightning) is not installed: '
                                 'pip install "paraloom[lightning]"')
