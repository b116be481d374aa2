"""The scheduler registry: comm.scheduler's names (paraloom.config.choices.SCHEDULERS) -> policy classes.

The module that implements each name is `paraloom.config.choices.SCHEDULER_MODULES`; importing this
module imports those, whose `@register_scheduler` classes (comm/policies.py) fill the registry.

Each policy class carries, as class attributes, what the engine must do for it (`own_group`,
`credit_window`, `cuts_pieces`, `defers_updates`; comm/policies.py's FifoScheduler says what each
means): the engine reads them through `SCHEDULERS[name]` and never compares a scheduler's name.
"""

from __future__ import annotations

import importlib

from paraloom.comm.policies import REGISTERED
from paraloom.config.choices import SCHEDULER_MODULES
from paraloom.config.choices import SCHEDULERS as NAMES
from paraloom.config.rules import check_name

for _module in sorted(set(SCHEDULER_MODULES.values())):
    importlib.import_module(f"paraloom.comm.{_module}")
SCHEDULERS = {name: REGISTERED[name] for name in NAMES}  # in the planner's order
# what a policy class declares for the engine, besides `name` and `next_batch`
ENGINE_NEEDS = ("own_group", "credit_window", "cuts_pieces", "defers_updates")


def make_scheduler(name: str):
    """A fresh policy object for comm.scheduler=`name`; an unknown name lists the valid ones."""
    return SCHEDULERS[check_name("comm.scheduler", name, NAMES)]()
