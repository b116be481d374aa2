"""Imported by the forkserver alone (prestart.PRELOAD, first): the server dies with its launcher.

A launcher killed outright leaves its forkserver to notice on its own, which it does only after
tearing down the torch it preloaded (seconds); its workers die with it (train/stopping.py's
`die_with_parent`), so it must not linger. The kernel kills it at once instead.
"""

from paraloom.train.stopping import die_with_parent

die_with_parent()
