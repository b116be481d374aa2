"""Enumerate the valid plans for a model on so many nodes, predict each, rank them, pick a node count."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

from paraloom.config.choices import ALL_REDUCE_ALGORITHMS, COMPRESSORS, SCHEDULERS
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.model_profile import ModelProfile
from paraloom.perfmodel.plan import Estimate, Options, Plan

EXACT_NOTE = "changes the math (convergence differs from synchronous SGD)"
SERVERS = (1, 2, 4)  # parameter-server shard counts tried
VIRTUAL_STAGES = (2, 4)  # model chunks per stage tried with interleaved 1F1B


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=32)
def tp_sizes(spec: str) -> tuple[int, ...]:
    """Sizes tensor parallelism must divide (heads, MLP width, vocabulary); () if it cannot apply."""
    from paraloom.models.gpt import Block, Head
    from paraloom.perfmodel.measure.specs import build_from_spec

    model, _ = build_from_spec(spec, "meta")
    sizes = []
    for m in model.modules():
        if isinstance(m, Block):
            sizes += [m.attn.n_heads, m.mlp.proj.in_features]  # heads, MLP width
        elif isinstance(m, Head):
            sizes.append(m.out.out_features)
    return tuple(sizes)


def is_exact(plan: Plan) -> bool:
    """Whether the plan computes synchronous SGD's update (same model after every step)."""
    return plan.compressor == "none" and plan.sync == "sync" and \
        (not plan.servers or plan.consistency == "bsp")


def grids(world: int, profile: ModelProfile, hw: Hardware, global_batch: int) -> list[Plan]:
    """Every (dp, tp, pp, micro-batches) on `world` devices the model and the batch allow."""
    sizes = tp_sizes(profile.spec)
    plans = []
    for tp in divisors(world):
        if tp > 1 and (not sizes or any(s % tp for s in sizes) or tp > hw.devices_per_node
                       and hw.devices_per_node > 1):
            continue  # Megatron keeps tensor parallelism inside a node where a node has several devices
        for pp in divisors(world // tp):
            dp = world // tp // pp
            if pp > len(profile.layers) or global_batch % dp:
                continue
            per_replica = global_batch // dp
            choices = [m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256) if per_replica % m == 0]
            if pp > 1:  # fewer micro-batches than stages leaves stages idle; keep m >= pp
                choices = [m for m in choices if m >= pp] or [per_replica]
            for m in choices:
                plans.append(Plan(dp=dp, tp=tp, pp=pp, microbatches=m))
                plans += sharded(dp, tp, pp, m, hw)
                # interleaved 1F1B where each stage can hold v chunks and micro-batches come in groups of pp
                plans += [Plan(dp=dp, tp=tp, pp=pp, microbatches=m, schedule="interleaved_1f1b",
                               virtual_stages=v)
                          for v in VIRTUAL_STAGES if pp > 1 and m % pp == 0 and pp * v <= len(profile.layers)]
    return plans


def sharded(dp: int, tp: int, pp: int, m: int, hw: Hardware) -> list[Plan]:
    """The sharding levels paraloom trains on a grid (parallel.shard): on whole replicas (tp = pp = 1)
    the optimizer alone, and gradients, full and, across nodes, hybrid (a
    node's data-parallel ranks shard one copy of their tp slices); with accumulation (m > 1) each
    fully sharded level both ways its gradients add up (parallel.shard_accumulate: unsharded, one
    reduction; sharded, less memory and m reductions). With pipeline stages (pp > 1) each stage is
    sharded over its data-parallel ranks and its units stay gathered through the step's micro-batches,
    so gradients and full are one plan there: full."""
    if dp == 1:
        return []
    levels = ("optimizer", "gradients", "full") if tp == pp == 1 else ("gradients", "full") if pp == 1 \
        else ("full",)
    out = [Plan(dp=dp, tp=tp, pp=pp, microbatches=m, shard=level) for level in levels]
    node = hw.devices_per_node // tp  # data-parallel ranks a node holds (tp groups inside a node)
    if 1 < node < dp and dp % node == 0:
        out.append(Plan(dp=dp, tp=tp, pp=pp, microbatches=m, shard="hybrid", shard_group=node))
    if m > 1:
        out += [replace(p, shard_accumulate="sharded") for p in out if p.shard != "optimizer"]
    return out


def variants(base: Plan, *, exact_only: bool) -> list[Plan]:
    """The data-parallel choices on a grid: scheduler, algorithm, then compressors, sync and servers;
    a fully sharded plan has none (its collectives are the units' gathers and reductions)."""
    if base.dp == 1 or base.shard not in ("none", "optimizer"):
        return [base]
    if base.shard == "optimizer":  # the sharded optimizer reduce-scatters in the engine's order
        return [replace(base, scheduler=s) for s in SCHEDULERS if s != "priority"]
    out = [replace(base, scheduler=s, algorithm=a)
           for s, a in itertools.product(SCHEDULERS, ALL_REDUCE_ALGORITHMS) if a != "native"]
    if base.tp == 1 and base.pp == 1:
        out += [replace(base, servers=k, consistency="bsp") for k in SERVERS]
    if not exact_only:
        out += [replace(base, compressor=c) for c in COMPRESSORS]
        out.append(replace(base, sync="one_step_delay"))
        if base.tp == 1 and base.pp == 1:
            out += [replace(base, servers=k, consistency=c) for k in SERVERS for c in ("asp", "ssp")]
    return out


@dataclass(frozen=True)
class Ranked:
    nodes: int
    estimates: list[Estimate]  # fitting plans, fastest first
    dropped: int  # plans that do not fit in memory

    @property
    def best(self) -> Estimate | None:
        """The fastest plan that keeps synchronous SGD's math, or else the fastest: a recommendation
        does not trade convergence for speed unasked (the table shows both)."""
        exact = [e for e in self.estimates if is_exact(e.plan)]
        return exact[0] if exact else (self.estimates[0] if self.estimates else None)


def rank(profile: ModelProfile, hw: Hardware, nodes: int, global_batch: int, *,
         options: Options | None = None, exact_only: bool = False, keep: int = 8) -> Ranked:
    """Predict every plan on `nodes` nodes: grids first, then the data-parallel variants of the `keep`
    best grids. Ties (to 4 significant digits) go to plans that keep the math, then to fewer devices,
    then to fewer moving parts (`_moving_parts`)."""
    world = nodes * hw.devices_per_node
    bases = [estimate(profile, hw, plan, global_batch, options)
             for plan in grids(world, profile, hw, global_batch)]
    fitting = sorted((e for e in bases if e.fits), key=lambda e: e.step_s)
    dropped = len(bases) - len(fitting)
    seen = {e.plan for e in bases}
    out = list(fitting)
    # the variants of the best grids; sharding levels are grids of their own (they make plans fit that
    # would not), so the best unsharded grids get their variants whatever sharding does
    unsharded = [e for e in fitting if e.plan.shard == "none"][:keep]
    for base in [*fitting[:keep], *(e for e in unsharded if e not in fitting[:keep])]:
        for plan in variants(base.plan, exact_only=exact_only):
            if plan in seen or plan.devices > world:
                continue
            seen.add(plan)
            e = estimate(profile, hw, plan, global_batch, options)
            if e.fits:
                out.append(e)
            else:
                dropped += 1
    out.sort(key=lambda e: (-float(f"{e.samples_per_s:.4g}"), not is_exact(e.plan), e.plan.devices,
                            _moving_parts(e.plan), e.plan.label()))
    return Ranked(nodes=nodes, estimates=out, dropped=dropped)


SHARD_ORDER = ("none", "optimizer", "gradients", "hybrid", "full")  # the least sharded first


def _moving_parts(plan: Plan) -> tuple[int, int, int]:
    """Between plans equally fast, the one with fewer moving parts first: less sharding (a sharded
    plan that buys nothing is only more collectives), fewer micro-batches, no compression."""
    return SHARD_ORDER.index(plan.shard), plan.microbatches, int(plan.compressor != "none")


def parse_nodes(text: str) -> list[int]:
    """"1..64" (powers of two from 1 to 64, and 64), "8" or "1,2,3"."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split("..", 1))
            if not 1 <= lo <= hi:
                raise ValueError
            out, n = [], lo
            while n < hi:
                out.append(n)
                n *= 2
            return [*out, hi]
        out = sorted({int(x) for x in text.split(",")})
        if not out or out[0] < 1:
            raise ValueError
        return out
    except ValueError:
        raise UserError(f"--nodes {text!r} is not a node count; write 8, 1..64 or 1,2,4") from None


def parse_plan(text: str) -> Plan:
    """"dp=4,tp=2,pp=2,microbatches=8,scheduler=priority" -> Plan."""
    fields = {f for f in Plan.__dataclass_fields__}
    kwargs = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise UserError(f"--plan item {item!r} is not KEY=VALUE with KEY one of "
                            f"{', '.join(sorted(fields))}")
        kwargs[key] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value, value)
    return Plan(**kwargs)


def recommend(results: list[Ranked], floor: float) -> tuple[Ranked, list[float]]:
    """The node count with the most throughput among those scaling at >= `floor` efficiency.

    Efficiency is the best plan's throughput per node against the smallest node count's (1.0 there).
    """
    usable = [r for r in results if r.estimates]
    if not usable:
        raise UserError("no plan fits in memory at any node count; add nodes, recompute or a smaller batch")
    base = usable[0].best.samples_per_s / usable[0].nodes
    eff = [r.best.samples_per_s / r.nodes / base if r.estimates else 0.0 for r in results]
    ok = [(r, e) for r, e in zip(results, eff, strict=True) if r.estimates and e >= floor]
    best = max(ok, key=lambda pair: pair[0].best.samples_per_s)[0] if ok else usable[0]
    return best, eff
