"""`paraloom cluster up|down|status`: the emulated cluster's lifecycle."""

from __future__ import annotations

from typing import Annotated

import typer

from paraloom.config.errors import UserError

cluster_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="Emulated cluster: network namespaces joined by shaped links (needs root).")


@cluster_app.command("up")
def cluster_up(
    nodes: Annotated[int, typer.Option(help="number of nodes (network namespaces)")] = 4,
    bandwidth: Annotated[str, typer.Option(help="each node's link, each way: 100mbit, 1gbit")] = "1gbit",
    name: Annotated[str, typer.Option(help="cluster name (1-8 lowercase letters or digits)")] = "default",
    latency: Annotated[str | None, typer.Option(help="not available here: netem is missing")] = None,
) -> None:
    """Bring an emulated cluster up; it stays up until `paraloom cluster down`."""
    from paraloom.cluster import ClusterSpec, EmulatedCluster, parse_rate

    if latency is not None:
        raise UserError("--latency needs the netem qdisc, which this kernel does not have; "
                        "links are shaped in bandwidth only")
    made = EmulatedCluster(ClusterSpec(nodes, parse_rate(bandwidth), name)).up()
    print(f"up: {made.describe()}")


@cluster_app.command("down")
def cluster_down(
    name: Annotated[str | None, typer.Option(help="cluster to remove (default: every cluster)")] = None,
    stale: Annotated[bool, typer.Option(
        "--stale", help="only the clusters whose command (`paraloom train --emulate`) was killed")] = False,
) -> None:
    """Stop everything running on an emulated cluster and remove its namespaces."""
    from paraloom.cluster import EmulatedCluster, list_clusters
    from paraloom.cluster.emulated import orphaned_clusters

    if stale and name:
        raise UserError("give --name or --stale, not both")
    if stale:
        targets = orphaned_clusters()
    else:
        targets = [EmulatedCluster.attach(name)] if name else list(list_clusters().values())
    for target in targets:
        target.down()
        print(f"down: {target.name}")
    if not targets:
        print("no orphaned emulated cluster" if stale else "no emulated cluster is up")


@cluster_app.command("status")
def cluster_status() -> None:
    """List the emulated clusters that are up."""
    from paraloom.cluster import list_clusters

    clusters = list_clusters()
    for c in clusters.values():
        print(c.describe())
    if not clusters:
        print("no emulated cluster is up")
