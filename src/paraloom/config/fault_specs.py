"""The `run.inject` fault specs: parsed and checked before any worker starts (torch-free).

See `paraloom.train.faults` for what each fault does when it fires.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraloom.config.choices import FAULT_KINDS as KINDS
from paraloom.config.errors import UserError


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: a random rank each step (slow only)
    step: int | None = None
    factor: float = 1.0
    node: int | None = None  # lose: the cluster node whose agent stops for good
    back: float | None = None  # lose: seconds after which the node starts again (None: never)

    def text(self) -> str:
        if self.kind == "lose":
            back = f",back={self.back:g}" if self.back is not None else ""
            return f"lose:node={self.node},step={self.step}{back}"
        rank = "random" if self.rank is None else self.rank
        tail = f"step={self.step}" if self.step is not None else f"factor={self.factor:g}"
        return f"{self.kind}:rank={rank},{tail}"


def parse_faults(text: str) -> list[Fault]:
    faults = [_parse_one(part.strip()) for part in text.split(";") if part.strip()]
    if not faults:
        raise UserError("run.inject is empty; give e.g. kill:rank=1,step=30")
    return faults


def _parse_one(spec: str) -> Fault:
    kind, sep, rest = spec.partition(":")
    if kind not in KINDS:
        raise UserError(f"--inject {spec!r}: unknown fault {kind!r}; choose one of: {', '.join(KINDS)}")
    wanted = KINDS[kind]
    optional = ("back",) if kind == "lose" else ()
    expected = f"--inject {spec!r}: expected {kind}:" + ",".join(f"{k}=..." for k in wanted) + \
        "".join(f"[,{k}=...]" for k in optional)
    values: dict[str, str] = {}
    for item in rest.split(",") if sep else []:
        key, eq, value = item.strip().partition("=")
        if not eq or key not in (*wanted, *optional) or key in values:
            raise UserError(expected)
        values[key] = value.strip()
    if set(wanted) - set(values):
        raise UserError(expected)
    if kind == "lose":
        return _lose(spec, values)
    rank_text = values["rank"]
    if rank_text == "random" and kind == "slow":
        rank = None
    elif rank_text.isdigit():
        rank = int(rank_text)
    else:
        allowed = "a rank number or 'random'" if kind == "slow" else "a rank number"
        raise UserError(f"--inject {spec!r}: rank must be {allowed}, got {rank_text!r}")
    if kind in ("slow", "slow_data"):
        try:
            factor = float(values["factor"])
        except ValueError:
            raise UserError(f"--inject {spec!r}: factor must be a number, got {values['factor']!r}") from None
        if not 1.0 <= factor <= 100.0:
            raise UserError(f"--inject {spec!r}: factor must lie in [1, 100], got {factor:g}")
        return Fault(kind, rank, factor=factor)
    if not values["step"].isdigit() or int(values["step"]) < 1:
        raise UserError(f"--inject {spec!r}: step must be a whole number >= 1, got {values['step']!r}")
    return Fault(kind, rank, step=int(values["step"]))


def _lose(spec: str, values: dict[str, str]) -> Fault:
    if not values["node"].isdigit() or int(values["node"]) < 1:
        raise UserError(f"--inject {spec!r}: node must be a node number >= 1 (node 0 hosts the rendezvous), "
                        f"got {values['node']!r}")
    if not values["step"].isdigit() or int(values["step"]) < 1:
        raise UserError(f"--inject {spec!r}: step must be a whole number >= 1, got {values['step']!r}")
    back = None
    if "back" in values:
        try:
            back = float(values["back"])
        except ValueError:
            raise UserError(f"--inject {spec!r}: back must be seconds, got {values['back']!r}") from None
        if not 0 <= back <= 3600:
            raise UserError(f"--inject {spec!r}: back must lie in [0, 3600] seconds, got {back:g}")
    return Fault("lose", None, step=int(values["step"]), node=int(values["node"]), back=back)


def check_lost_nodes(faults: list[Fault], node_range: tuple[int, int] | None, nodes: int | None) -> None:
    """`lose` needs a cluster run that may shrink: run.nodes=MIN..MAX with MAX the cluster's nodes."""
    lost = [f for f in faults if f.kind == "lose"]
    if node_range is not None and nodes is None:
        raise UserError(f"run.nodes={node_range[0]}..{node_range[1]} needs a cluster: "
                        "give --cluster NAME or --emulate NODESxRATE")
    if node_range is not None and node_range[1] != nodes:
        raise UserError(f"run.nodes={node_range[0]}..{node_range[1]}: MAX must be the cluster's "
                        f"{nodes} nodes")
    if not lost:
        return
    if node_range is None:
        raise UserError(f"--inject {lost[0].text()} needs run.nodes=MIN..MAX (on a cluster, or local nodes), "
                        "so that the run may go on without the node")
    low, high = node_range
    if len({f.node for f in lost}) > high - low:
        raise UserError(f"--inject loses {len({f.node for f in lost})} nodes; run.nodes={low}..{high} "
                        f"goes on without at most {high - low}")
    for fault in lost:
        if fault.node >= high:
            raise UserError(f"--inject {fault.text()}: node {fault.node} is out of range; the cluster has "
                            f"nodes 0..{high - 1}")


def check_faults(faults: list[Fault], world_size: int, total_steps: int | None = None) -> None:
    """Refuse ranks outside the world and steps past the end of the run."""
    for fault in faults:
        if fault.kind == "lose":
            continue  # nodes, not ranks: check_lost_nodes
        if fault.rank is not None and fault.rank >= world_size:
            raise UserError(f"--inject {fault.text()}: rank {fault.rank} is out of range; "
                            f"this run has ranks 0..{world_size - 1}")
        if fault.step is not None and total_steps is not None and fault.step > total_steps:
            raise UserError(f"--inject {fault.text()}: step {fault.step} is out of range; "
                            f"this run has steps 1..{total_steps}")
