"""An emulated cluster on one machine: network namespaces joined by shaped links over real TCP."""

from paraloom.cluster.emulated import EmulatedCluster, free_name, list_clusters
from paraloom.cluster.spec import ClusterSpec, parse_emulate, parse_rate

__all__ = ["ClusterSpec", "EmulatedCluster", "free_name", "list_clusters", "parse_emulate", "parse_rate"]
