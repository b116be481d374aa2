"""Scheduling policies are pure functions: literal expectations, no process group."""

import pytest
import torch

from paraloom.comm.executor import CommThread, Executor
from paraloom.comm.policies import CommTask, FifoScheduler, WaitFreeScheduler
from paraloom.comm.schedulers import ENGINE_NEEDS, SCHEDULERS, make_scheduler
from paraloom.config.choices import SCHEDULERS as SCHEDULER_NAMES
from paraloom.config.errors import UserError
from paraloom.data_parallel.bucket import assign_buckets


def test_wait_free_launches_the_ready_prefix_in_key_order():
    policy = WaitFreeScheduler()
    assert policy.next_batch([0], 0, False) == [0]
    assert policy.next_batch([2, 1], 0, False) == []  # 0 is not ready: nothing may overtake it
    assert policy.next_batch([2, 1, 0], 0, False) == [0, 1, 2]
    assert policy.next_batch([4, 3], 3, False) == [3, 4]


def test_fifo_waits_for_the_end():
    policy = FifoScheduler()
    assert policy.next_batch([0, 1, 2], 0, False) == []
    assert policy.next_batch([2, 0, 1], 0, True) == [0, 1, 2]


class _Log:
    def __init__(self):
        self.order = []

    def task(self, key):
        def launch():
            self.order.append(key)
            return _Noop()
        return CommTask(key, 4, launch=launch)


class _Noop:
    def wait(self):
        return None


@pytest.mark.parametrize(("name", "after_marks"), [("wait_free", [0, 1]), ("fifo", [])])
def test_executor_launches_per_policy_and_complains_about_missing_tasks(name, after_marks):
    log, executor = _Log(), Executor(make_scheduler(name))
    for key in (1, 0):
        executor.mark_ready(log.task(key))
    assert log.order == after_marks and executor.launched == len(after_marks)
    with pytest.raises(RuntimeError, match=r"tasks \[2\] were never marked ready"):
        executor.wait_all(3)
    executor.mark_ready(log.task(2))
    assert [t.key for t in executor.wait_all(3)] == [0, 1, 2]
    assert log.order == [0, 1, 2]
    executor.reset()


def test_unknown_scheduler_lists_choices():
    with pytest.raises(UserError, match="choose one of: fifo, wait_free"):
        make_scheduler("lifo")


def test_comm_thread_runs_in_order_and_reraises():
    thread, seen = CommThread(), []
    handles = [thread.submit(lambda i=i: seen.append(i)) for i in range(5)]
    for h in handles:
        h.wait()
    assert seen == [0, 1, 2, 3, 4]
    failing = thread.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    thread.close()


def test_buckets_fill_in_order_with_a_small_first_one_and_split_by_dtype():
    f32, f16 = torch.float32, torch.float16
    sizes = [(400, f32), (400, f32), (400, f32), (400, f32), (900, f32), (100, f32)]
    assert assign_buckets(sizes, bucket_bytes=1000, first_bucket_bytes=300) == [[0], [1, 2, 3], [4, 5]]
    assert assign_buckets(sizes, bucket_bytes=10**9, first_bucket_bytes=10**9) == [[0, 1, 2, 3, 4, 5]]
    mixed = [(100, f32), (100, f16), (100, f32), (100, f16)]
    assert assign_buckets(mixed, bucket_bytes=200, first_bucket_bytes=200) == [[0, 2], [1, 3]]
    assert assign_buckets([], 10, 10) == []


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_each_scheduler_declares_what_the_engine_must_do_for_it(name):
    """The engine reads a scheduler's needs from its class (no name comparisons): each one says
    every need itself, as a bool, rather than inheriting it by accident."""
    declared = vars(SCHEDULERS[name])
    assert {need: type(declared.get(need)) for need in ENGINE_NEEDS} == dict.fromkeys(ENGINE_NEEDS, bool)
    assert SCHEDULERS.keys() == set(SCHEDULER_NAMES)


def test_only_the_priority_scheduler_needs_more_than_the_engine_group_and_buckets():
    needs = {name: tuple(getattr(cls, need) for need in ENGINE_NEEDS) for name, cls in SCHEDULERS.items()}
    assert needs == {"fifo": (False,) * 4, "wait_free": (False,) * 4, "priority": (True,) * 4}
