"""comm.scheduler=auto: three schedulers tried on the run's own steps, one kept, the math untouched."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.data_parallel import DataParallel
from paraloom.data_parallel.auto import CANDIDATES, MARGIN, TRIAL_STEPS, fastest, trial_steps
from paraloom.models import MLP

STEPS = TRIAL_STEPS + 6


def _train(rank, world, scheduler, nan_at=None):
    torch.manual_seed(0)
    model = MLP((1, 8, 8), 10, hidden=64, depth=3)
    engine = DataParallel(model, scheduler=scheduler, bucket_mb=0.01, first_bucket_mb=0.005,
                          partition_mb=0.005)  # several buckets, priority several partitions
    engine.guard_nonfinite()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    stepped = []
    for step in range(1, STEPS + 1):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = F.cross_entropy(engine(x), y)
        (loss * float("nan") if step == nan_at and rank == 1 else loss).backward()
        stepped.append(engine.step(optimizer))
    engine.finish()
    chosen = engine.auto.chosen if engine.auto is not None else None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pre_hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    engine.close()
    return state, chosen, stepped, pre_hooks


def test_auto_trains_exactly_as_a_fixed_scheduler_and_every_rank_keeps_the_same_one():
    auto = run_workers(_train, 2, "auto", timeout=120)
    fixed = run_workers(_train, 2, "wait_free", timeout=120)
    (state, chosen, _, pre_hooks), (other_state, other_chosen, _, _) = auto
    assert chosen == other_chosen and chosen["scheduler"] in CANDIDATES
    # the priority trials' forward pre-hooks leave with them: one priority updater's at most
    holding = sum(1 for m in MLP((1, 8, 8), 10, hidden=64, depth=3).modules()
                  if any(True for _ in m.parameters(recurse=False))) + 1  # and the model itself
    assert pre_hooks == (holding if chosen["scheduler"] == "priority" else 0)
    assert list(chosen["seconds"]) == list(CANDIDATES) and chosen["scheduler"] == fastest(chosen["seconds"])
    for key, value in fixed[0][0].items():
        torch.testing.assert_close(state[key], value)
        torch.testing.assert_close(other_state[key], value)


@pytest.mark.parametrize(("seconds", "kept"), [
    ({"wait_free": 1.0, "fifo": 0.99, "priority": 1.2}, "wait_free"),  # 1% faster: a tie, the default stays
    ({"wait_free": 1.0, "fifo": 0.97, "priority": 0.9}, "priority"),  # the fastest, by more than the margin
    ({"wait_free": 1.0, "fifo": 0.97, "priority": 1.1}, "fifo"),
    ({"wait_free": 0.8, "fifo": 0.9, "priority": 1.0}, "wait_free"),  # the default is the fastest
    ({25.0: 2.0, 1.0: 2.0 * (1 - MARGIN)}, 25.0),  # exactly the margin is not enough
    ({25.0: 2.0}, 25.0),
])
def test_a_candidate_replaces_the_default_only_when_faster_by_more_than_the_margin(seconds, kept):
    assert fastest(seconds) == kept


@pytest.mark.parametrize("nan_at", [10, STEPS - 2], ids=["during the trials", "after the choice"])
def test_the_non_finite_guard_holds_through_every_switch(nan_at):
    results = run_workers(_train, 2, "auto", nan_at, timeout=120)
    for _, _, stepped, _ in results:
        assert [i + 1 for i, ok in enumerate(stepped) if not ok] == [nan_at]


@pytest.mark.parametrize(("sets", "match"), [
    (["comm.compressor=fp16"], "comm.scheduler=auto picks"),
    (["comm.sync=one_step_delay"], "comm.scheduler=auto picks"),
    (["optim.clip_norm=1.0"], "comm.scheduler=auto may pick it"),
    (["parallel.tp=2", "model.name=gpt", "data.name=text"], "data parallelism alone"),
])
def test_auto_is_refused_where_it_cannot_choose_freely(sets, match):
    with pytest.raises(UserError, match=match):
        load_config(None, ["comm.scheduler=auto", *sets]).validate_world(2)


def _train_buckets(rank, world, scheduler, bucket_mb, steps):
    torch.manual_seed(0)
    model = MLP((1, 8, 8), 10, hidden=512, depth=4)  # 3.4 MB of gradients: 1 MB buckets group them apart
    engine = DataParallel(model, scheduler=scheduler, bucket_mb=bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        F.cross_entropy(engine(x), y).backward()
        engine.step(optimizer)
    engine.finish()
    chosen = engine.auto.chosen if engine.auto is not None else None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return state, chosen


@pytest.mark.parametrize("scheduler", ["wait_free", "auto"])
def test_bucket_mb_auto_tries_the_sizes_that_group_the_model_apart_and_trains_exactly(scheduler, capfd):
    # the schedulers at 25 MB, then 25 MB against 1 MB (5 and 100 group the model as 25 does)
    steps = trial_steps(3 if scheduler == "auto" else 1) + trial_steps(2) + 4
    auto = run_workers(_train_buckets, 2, scheduler, "auto", steps, timeout=180)
    fixed = run_workers(_train_buckets, 2, "wait_free", 25.0, steps, timeout=180)
    (state, chosen), (_, other) = auto
    assert chosen == other
    if chosen["scheduler"] == "priority":  # priority cuts partitions: no bucket size to choose
        assert chosen["bucket_mb"] is None and chosen["bucket_seconds"] == {}
    else:
        assert list(chosen["bucket_seconds"]) == [25.0, 1.0]  # the size given first
        assert chosen["bucket_mb"] == fastest(chosen["bucket_seconds"])
    for key, value in fixed[0][0].items():
        torch.testing.assert_close(state[key], value)
    assert "comm.bucket_mb=auto" in capfd.readouterr().err


@pytest.mark.parametrize(("sets", "match"), [
    (["comm.bucket_mb=auto", "comm.scheduler=priority"], "priority cuts partitions"),
    (["comm.bucket_mb=auto", "comm.compressor=fp16"], "comm.bucket_mb=auto tries bucket sizes"),
    (["comm.bucket_mb=big"], "must be a number of MB or auto"),
    (["comm.bucket_mb=auto", "parallel.pp=2", "model.name=gpt", "data.name=text"], "data parallelism alone"),
])
def test_bucket_mb_auto_is_refused_where_it_cannot_choose_freely(sets, match):
    with pytest.raises(UserError, match=match):
        load_config(None, sets).validate_world(2)
