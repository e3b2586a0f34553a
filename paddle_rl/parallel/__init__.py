"""Data, sharding, tensor and pipeline parallelism on paddle.distributed's public collectives."""
from .topology import Topology, TopologyError, build_topology, single_process, topology_from_config

__all__ = ["Topology", "TopologyError", "build_topology", "single_process", "topology_from_config"]
