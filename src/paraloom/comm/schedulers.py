"""The scheduler registry: comm.scheduler's names (paraloom.config.choices.SCHEDULERS) -> policy classes.

Each policy class carries, as class attributes, what the engine must do for it (`own_group`,
`credit_window`, `cuts_pieces`, `defers_updates`; comm/policies.py's FifoScheduler says what each
means): the engine reads them through `SCHEDULERS[name]` and never compares a scheduler's name.
"""

from __future__ import annotations

from paraloom.comm.policies import FifoScheduler, WaitFreeScheduler
from paraloom.comm.priority import PriorityScheduler
from paraloom.config.choices import SCHEDULERS as NAMES
from paraloom.config.rules import check_name

SCHEDULERS = {cls.name: cls for cls in (FifoScheduler, WaitFreeScheduler, PriorityScheduler)}
# what a policy class declares for the engine, besides `name` and `next_batch`
ENGINE_NEEDS = ("own_group", "credit_window", "cuts_pieces", "defers_updates")


def make_scheduler(name: str):
    """A fresh policy object for comm.scheduler=`name`; an unknown name lists the valid ones."""
    return SCHEDULERS[check_name("comm.scheduler", name, NAMES)]()
