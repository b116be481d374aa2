"""Sync modes of DataParallel against plain one-process references (no engine, no process group).

Each worker of a reference is its own model copy in this process: OD-SGD (one_step_delay),
local SGD, and the sharded optimizer; then convergence on real data with the real trainer, and
the error paths.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from dp_reference import setup, steps

from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.data import load_dataset
from paraloom.data_parallel import DataParallel, DistributedOptimizer
from paraloom.models import build_model
from paraloom.train import train
from paraloom.train.loss_eval import batch_loss

STEPS = 10
N = 100  # training samples used: batches of 24, 24, 24, 24 and a short one of 4 per epoch
TINY, HUGE = 1e-6, 25.0  # MB: one bucket per parameter / one bucket for the whole model

# Building the first optimizer imports torch._dynamo (seconds on 2 cores); do it once here, so
# forked ranks inherit it instead of each paying for it.
torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


def _make(opt_name):
    """The cnn of dp_reference with sgd (momentum 0.9), adam, or plain_sgd (no momentum)."""
    split, model, optimizer = setup("cnn", "adam" if opt_name == "adam" else "sgd")
    if opt_name == "plain_sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return split, model, optimizer


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train_engine(rank, world, opt_name, engine_kwargs):
    """The ordinary loop: backward, engine.step(optimizer); finish() before reading parameters."""
    split, model, optimizer = _make(opt_name)
    engine = DataParallel(model, **engine_kwargs)
    for idx, count in steps(N, rank, world, count=STEPS):
        loss, _ = batch_loss(engine, split.x_train[idx], split.y_train[idx], scale=world / count)
        loss.backward()
        engine.step(optimizer)
    engine.finish()
    params = _params(model)
    engine.close()
    return params


def _train_drop_in(rank, world, opt_name, engine_kwargs):
    """The DDP user's loop: zero_grad, backward, optimizer.step() through DistributedOptimizer."""
    split, model, optimizer = _make(opt_name)
    engine = DataParallel(model, **engine_kwargs)
    optimizer = DistributedOptimizer(optimizer, engine)
    for idx, count in steps(N, rank, world, count=STEPS):
        optimizer.zero_grad()
        loss, _ = batch_loss(engine, split.x_train[idx], split.y_train[idx], scale=world / count)
        loss.backward()
        optimizer.step()
    engine.finish()
    params = _params(model)
    engine.close()
    return params


# ---- one-process references: worker w is models[w], fed rank w's shard


def _worker_grads(split, models, world, t, shards):
    """Every worker's gradient of its scaled loss at its own weights, for step t."""
    grads = []
    for model, shard in zip(models, shards, strict=True):
        idx, count = shard[t]
        loss, _ = batch_loss(model, split.x_train[idx], split.y_train[idx], scale=world / count)
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    return grads


def _average(tensors_per_worker):
    return [torch.stack(ts).sum(0) / len(ts) for ts in zip(*tensors_per_worker, strict=True)]


def _optimizer_step(model, optimizer, grads):
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    optimizer.step()


def _od_sgd_reference(opt_name, world, delay_lr=None):
    """OD-SGD: W_g takes step t-1's averaged gradient at step t; W_l = W_g - lr * g_t (own gradient)."""
    split, global_model, optimizer = _make(opt_name)  # the optimizer's state belongs to W_g
    workers = [copy.deepcopy(global_model) for _ in range(world)]
    lr = delay_lr if delay_lr is not None else optimizer.param_groups[0]["lr"]
    shards = [list(steps(N, w, world, count=STEPS)) for w in range(world)]
    previous = None
    for t in range(STEPS):
        grads = _worker_grads(split, workers, world, t, shards)
        if previous is not None:
            _optimizer_step(global_model, optimizer, _average(previous))
        with torch.no_grad():
            for model, own in zip(workers, grads, strict=True):
                for p, w_g, g in zip(model.parameters(), global_model.parameters(), own, strict=True):
                    p.copy_(w_g - lr * g)
        previous = grads
    _optimizer_step(global_model, optimizer, _average(previous))  # finish(): W_l <- W_g everywhere
    return _params(global_model)


def _local_sgd_reference(opt_name, world, local_steps, warmup):
    """Local SGD: `warmup` synchronous steps, then own optimizer steps, parameters averaged every H."""
    built = [_make(opt_name) for _ in range(world)]  # optimizer state is per worker, never averaged
    split = built[0][0]
    models = [model for _, model, _ in built]
    shards = [list(steps(N, w, world, count=STEPS)) for w in range(world)]
    for t in range(STEPS):
        grads = _worker_grads(split, models, world, t, shards)
        if t < warmup:
            grads = [_average(grads)] * world
        for (_, model, optimizer), g in zip(built, grads, strict=True):
            _optimizer_step(model, optimizer, g)
        if t >= warmup and (t - warmup + 1) % local_steps == 0:
            with torch.no_grad():
                for mean, *ps in zip(_average([_params(m) for m in models]),
                                     *(m.parameters() for m in models), strict=True):
                    for p in ps:
                        p.copy_(mean)
    if STEPS > warmup and (STEPS - warmup) % local_steps:  # finish(): one last averaging
        mean = _average([_params(m) for m in models])
        return [mean] * world
    return [_params(m) for m in models]


# ---- 1. OD-SGD


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bucket_mb", [TINY, HUGE])
def test_one_step_delay_equals_the_reference(world, bucket_mb):
    kwargs = {"sync": "one_step_delay", "bucket_mb": bucket_mb, "first_bucket_mb": bucket_mb}
    expected = _od_sgd_reference("sgd", world)
    for params in run_workers(_train_engine, world, "sgd", kwargs):
        torch.testing.assert_close(params, expected)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_one_step_delay_through_distributed_optimizer_equals_the_reference(opt_name):
    expected = _od_sgd_reference(opt_name, 2)
    for params in run_workers(_train_drop_in, 2, opt_name, {"sync": "one_step_delay"}):
        torch.testing.assert_close(params, expected)


@pytest.mark.parametrize(("world", "opt_name"), [(2, "sgd"), (3, "sgd"), (2, "adam")])
def test_one_step_delay_with_its_own_compensation_lr(world, opt_name):
    delay_lr = 0.02  # the optimizers' lr is 0.05 (sgd) / 0.01 (adam)
    kwargs = {"sync": "one_step_delay", "delay_lr": delay_lr, "bucket_mb": TINY, "first_bucket_mb": TINY}
    expected = _od_sgd_reference(opt_name, world, delay_lr=delay_lr)
    for params in run_workers(_train_engine, world, opt_name, kwargs):
        torch.testing.assert_close(params, expected)


# ---- 2. local SGD


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("local_steps", "warmup"), [(4, 0), (3, 2)])
@pytest.mark.parametrize(("opt_name", "bucket_mb"), [("sgd", TINY), ("adam", HUGE)])
def test_local_sgd_equals_the_reference(world, local_steps, warmup, opt_name, bucket_mb):
    kwargs = {"sync": "local_sgd", "local_steps": local_steps, "local_warmup": warmup,
              "bucket_mb": bucket_mb, "first_bucket_mb": bucket_mb}
    expected = _local_sgd_reference(opt_name, world, local_steps, warmup)
    results = run_workers(_train_engine, world, opt_name, kwargs)
    for params, mine in zip(results, expected, strict=True):  # rank r against worker r
        torch.testing.assert_close(params, mine)


@pytest.mark.parametrize(("local_steps", "warmup"), [(4, 0), (3, 2)])
def test_local_sgd_through_distributed_optimizer_equals_the_reference(local_steps, warmup):
    kwargs = {"sync": "local_sgd", "local_steps": local_steps, "local_warmup": warmup}
    expected = _local_sgd_reference("adam", 2, local_steps, warmup)
    for params, mine in zip(run_workers(_train_drop_in, 2, "adam", kwargs), expected, strict=True):
        torch.testing.assert_close(params, mine)


@pytest.mark.parametrize("world", [2, 3])
def test_local_sgd_averaging_every_step_is_synchronous_sgd(world):
    """Plain SGD: mean_w(W - lr g_w) == W - lr mean_w(g_w), so H=1 is ordinary data parallelism."""
    local = run_workers(_train_engine, world, "plain_sgd",
                        {"sync": "local_sgd", "local_steps": 1, "local_warmup": 0})
    synchronous = run_workers(_train_engine, world, "plain_sgd", {"sync": "sync"})
    for params in local:
        torch.testing.assert_close(params, synchronous[0])
    for params in synchronous[1:]:
        torch.testing.assert_close(params, synchronous[0])


# ---- 3. convergence on real data, with the real trainer


def _train_seeds(rank, world, sync, seeds):
    accuracies = []
    for seed in seeds:
        cfg = load_config(None, [f"run.seed={seed}", f"comm.sync={sync}", "comm.local_steps=4",
                                 "run.save_model=false"])
        accuracies.append(train(cfg, None, device=torch.device("cpu"))["test_accuracy"])
    return accuracies


@pytest.mark.timeout(300)
def test_delayed_and_local_sgd_converge_like_synchronous_training():
    """Default config (cnn on digits, adam, 12 epochs, batch 64) on 2 ranks, seeds 0, 1, 2.

    One run moves by +-0.5 pt between seeds (359 test images: one image = 0.28 pt), so the
    mean over three seeds is compared.
    """
    seeds = [0, 1, 2]
    means = {}
    for sync in ("sync", "one_step_delay", "local_sgd"):
        per_rank = run_workers(_train_seeds, 2, sync, seeds, timeout=240)
        assert per_rank[0] == per_rank[1]  # the accuracy is all-reduced: every rank reports it
        means[sync] = sum(per_rank[0]) / len(seeds)
    for mean in means.values():
        assert mean >= 0.95, means
        assert mean >= means["sync"] - 0.005, means


# ---- 4. sharded optimizer state


def _sharded_adam(rank, world, hidden):
    split = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", split.input_shape, split.n_classes, hidden=hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = DataParallel(model, shard_optimizer=True, bucket_mb=0.1, first_bucket_mb=0.1)
    for idx, count in steps(N, rank, world, count=3):
        loss, _ = batch_loss(engine, split.x_train[idx], split.y_train[idx], scale=world / count)
        loss.backward()
        engine.step(optimizer)
    engine.finish()
    out = engine.updater.state_bytes(), len(optimizer.state), len(engine.buckets), _params(model)
    engine.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_adam_holds_a_1_over_n_share_of_the_state(world):
    hidden = 256  # mlp on digits: 64*256 + 256*256 + 256*10 weights and biases = 85,002 parameters
    split = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", split.input_shape, split.n_classes, hidden=hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for idx, _count in steps(N, count=3):  # unsharded torch Adam on the full batch
        optimizer.zero_grad()
        F.cross_entropy(model(split.x_train[idx]), split.y_train[idx]).backward()
        optimizer.step()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 80_000
    total = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                for t in state.values() if torch.is_tensor(t))
    assert total >= 2 * n_params * 4  # exp_avg and exp_avg_sq in fp32, plus step counters
    for state_bytes, user_state, buckets, params in run_workers(_sharded_adam, world, hidden):
        assert buckets == 2  # two buckets: padding (< world elements each) counted twice
        assert abs(state_bytes - total / world) <= 0.05 * total / world, (state_bytes, total, world)
        assert user_state == 0  # the user's optimizer holds nothing
        torch.testing.assert_close(params, _params(model))


# ---- 5. error paths


def _errors(rank, world):
    """(mode, message) for every sync_gradients() the mode refuses, and the constructor UserErrors."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    out = []
    for name, kwargs, steps_before in [
        ("one_step_delay", {"sync": "one_step_delay"}, 0),
        ("shard_optimizer", {"shard_optimizer": True}, 0),
        ("local_sgd", {"sync": "local_sgd", "local_warmup": 0}, 0),
        ("local_sgd in warm-up", {"sync": "local_sgd", "local_warmup": 2}, 1),  # allowed: no error
        ("local_sgd after warm-up", {"sync": "local_sgd", "local_warmup": 2}, 2),
    ]:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = DataParallel(model, **kwargs)
        for _step in range(steps_before):
            F.cross_entropy(engine(x), y).backward()
            engine.step(optimizer)
        F.cross_entropy(engine(x), y).backward()
        try:
            engine.sync_gradients()
        except RuntimeError as exc:
            out.append((name, str(exc)))
        else:
            out.append((name, None))
        finally:
            engine.close()
    for kwargs in ({"sync": "bogus"}, {"scheduler": "priority", "sync": "local_sgd"}):
        try:
            DataParallel(torch.nn.Linear(3, 2), **kwargs)
        except UserError as exc:
            out.append((str(kwargs), str(exc)))
        else:
            out.append((str(kwargs), None))
    return out


def test_error_paths():
    for messages in run_workers(_errors, 2):
        by_name = dict(messages)
        assert by_name["local_sgd in warm-up"] is None  # the warm-up steps are synchronous
        for name in ("one_step_delay", "shard_optimizer", "local_sgd", "local_sgd after warm-up"):
            assert by_name[name] is not None, f"{name}: sync_gradients() did not raise"
            assert "engine.step" in by_name[name], (name, by_name[name])
        bogus = by_name[str({"sync": "bogus"})]
        assert bogus is not None and "'bogus'" in bogus
        assert all(valid in bogus for valid in ("sync", "one_step_delay", "local_sgd")), bogus
        priority = by_name[str({"scheduler": "priority", "sync": "local_sgd"})]
        assert priority is not None and "priority" in priority, priority
