"""The training recipe's optimizer pieces: optimizers by name, LARS and LAMB, schedules, lr scaling."""

from paraloom.optim.lamb import LAMB
from paraloom.optim.lars import LARS
from paraloom.optim.lr_schedule import SCHEDULES, check_schedule, lr_factor, make_schedule
from paraloom.optim.optimizers import check_optimizer, make_optimizer, optimizer_names
from paraloom.optim.scaling import scaled_lr

__all__ = ["LAMB", "LARS", "SCHEDULES", "check_optimizer", "check_schedule", "lr_factor", "make_optimizer",
           "make_schedule", "optimizer_names", "scaled_lr"]
