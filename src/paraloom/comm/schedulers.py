"""The scheduler registry: comm.scheduler's names (paraloom.config.choices.SCHEDULERS) -> policy classes."""

from __future__ import annotations

from paraloom.comm.policies import FifoScheduler, WaitFreeScheduler
from paraloom.comm.priority import PriorityScheduler
from paraloom.config.choices import SCHEDULERS as NAMES
from paraloom.config.rules import check_name

SCHEDULERS = {cls.name: cls for cls in (FifoScheduler, WaitFreeScheduler, PriorityScheduler)}


def make_scheduler(name: str):
    """A fresh policy object for comm.scheduler=`name`; an unknown name lists the valid ones."""
    return SCHEDULERS[check_name("comm.scheduler", name, NAMES)]()
