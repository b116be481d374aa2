"""Options more than one command shares: where a command runs (--cluster NAME / --emulate NODESxRATE)."""

from __future__ import annotations

import contextlib

from paraloom.errors import UserError


@contextlib.contextmanager
def cluster_from_options(name: str | None, emulate: str | None):
    """The cluster a command runs on: none (loopback), an existing one, or one made for it."""
    if name and emulate:
        raise UserError("give --cluster or --emulate, not both")
    if emulate is None:
        if name is None:
            yield None
            return
        from paraloom.cluster import EmulatedCluster

        yield EmulatedCluster.attach(name)
        return
    from paraloom.cluster import EmulatedCluster, free_name, parse_emulate

    spec = parse_emulate(emulate, name=free_name("emu"))
    with EmulatedCluster(spec) as made:
        yield made
