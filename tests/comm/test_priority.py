"""Priority scheduling: the P3 planner and the credit-limited issuing thread, without a process group."""

import threading
import time

import pytest

from paraloom.comm.executor import CreditExecutor
from paraloom.comm.policies import CommTask, WaitFreeScheduler
from paraloom.comm.priority import PlanTask, PriorityScheduler, busy_seconds, plan_order


def test_everything_ready_goes_in_priority_order():
    tasks = [PlanTask(key, 4, priority, 0.0) for key, priority in enumerate([3, 1, 2, 0])]
    assert plan_order(tasks, 1.0, credit_bytes=1000) == [3, 1, 2, 0]


def test_a_late_urgent_task_overtakes_what_the_credit_window_held_back():
    # two low-priority tasks ready at once, a top-priority one ready after 1 s; each takes 1 s
    tasks = [PlanTask(0, 10, 5, 0.0), PlanTask(1, 10, 5, 0.0), PlanTask(2, 10, 0, 1.0)]
    assert plan_order(tasks, 0.1, credit_bytes=10) == [0, 2, 1]  # one in flight: 2 jumps ahead of 1
    assert plan_order(tasks, 0.1, credit_bytes=20) == [0, 1, 2]  # both launched before 2 exists


def test_a_task_larger_than_the_window_goes_alone_and_ties_go_to_the_lower_key():
    tasks = [PlanTask(0, 100, 1, 0.0), PlanTask(1, 5, 1, 0.0), PlanTask(2, 5, 1, 0.0)]
    assert plan_order(tasks, 0.01, credit_bytes=10) == [0, 1, 2]


def test_backward_order_meets_forward_priority():
    # backward makes layer 3's gradient ready first and layer 0's last (priority = forward order)
    tasks = [PlanTask(key, 10, 3 - key, 0.1 * key) for key in range(4)]
    assert plan_order(tasks, 1.0, credit_bytes=10) == [0, 3, 2, 1]  # slow link: all queue, 0 first
    assert plan_order(tasks, 1e-4, credit_bytes=10) == [0, 1, 2, 3]  # fast link: nothing queues


def test_busy_seconds_is_the_union_of_intervals():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert busy_seconds([(0, 5), (1, 2)]) == pytest.approx(5.0)


def test_priority_scheduler_follows_its_order_once_planned():
    policy = PriorityScheduler()
    assert policy.next_batch([1, 0], 0, False) == [0, 1]  # no plan yet: wait-free key order
    policy.order = [2, 0, 1]
    assert policy.next_batch([0, 1], 0, False) == []  # 2 comes first and is not ready
    assert policy.next_batch([0, 1, 2], 0, False) == [2, 0, 1]
    assert policy.next_batch([1], 2, False) == [1]


class _Work:
    """A handle the test completes by hand."""

    def __init__(self):
        self.done = threading.Event()

    def wait(self):
        assert self.done.wait(5), "never completed"

    def is_completed(self):
        return self.done.is_set()


def _until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def test_credit_executor_keeps_the_window_and_the_policy_order():
    works, launched = {}, []

    def task(key):
        def launch():
            launched.append(key)
            works[key] = _Work()
            return works[key]
        return CommTask(key, 4, launch=launch)

    executor = CreditExecutor(WaitFreeScheduler(), credit_bytes=8)
    try:
        for key in (2, 0, 1, 3):
            executor.mark_ready(task(key))
        _until(lambda: len(launched) == 2)
        time.sleep(0.05)
        assert launched == [0, 1]  # 8 bytes of credit: two 4-byte tasks in flight, no more
        works[1].done.set()  # completion out of order frees credit all the same
        _until(lambda: len(launched) == 3)
        assert launched == [0, 1, 2]
        for key in (0, 2):
            works[key].done.set()
        executor.flush(4)
        _until(lambda: len(launched) == 4)
        works[3].done.set()
        assert [t.key for t in executor.wait_all(4)] == [0, 1, 2, 3]
        executor.reset()
        assert executor.launched == 0
    finally:
        executor.close()


def test_credit_executor_hands_a_launch_failure_to_the_waiter():
    def launch():
        raise ValueError("link down")

    executor = CreditExecutor(WaitFreeScheduler(), credit_bytes=8)
    try:
        executor.mark_ready(CommTask(0, 4, launch=launch))
        with pytest.raises(ValueError, match="link down"):
            executor.wait(0)
    finally:
        executor.close()
