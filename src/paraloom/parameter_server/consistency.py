"""When a parameter-server worker may read: BSP, ASP and SSP (Ho et al. 2013) as one clock rule.

A worker's clock is the number of gradients it has pushed. A worker at clock c may read the
parameters while c - min(clocks of all workers) <= s: s = 0 is bulk-synchronous (BSP: everyone
has pushed step c-1 first), s = infinity is asynchronous (ASP), anything between is stale-
synchronous (SSP with staleness s), which makes a fast worker wait once it is s clocks ahead.
"""

from __future__ import annotations

from collections.abc import Iterable

from paraloom.config.choices import CONSISTENCY
from paraloom.config.errors import UserError


def staleness_bound(consistency: str, staleness: int) -> int | None:
    """Clocks a reader may run ahead of the slowest worker; None for no bound (ASP)."""
    if consistency not in CONSISTENCY:
        raise UserError(f"ps.consistency={consistency!r} is not known; choose one of: "
                        f"{', '.join(CONSISTENCY)}")
    if staleness < 0:
        raise UserError(f"ps.staleness={staleness} must not be negative")
    return {"bsp": 0, "asp": None, "ssp": staleness}[consistency]


def may_read(clock: int, clocks: Iterable[int], bound: int | None) -> bool:
    """Whether a worker at `clock` may read, given every worker's clock as the server saw it."""
    return bound is None or clock - min(clocks) <= bound
