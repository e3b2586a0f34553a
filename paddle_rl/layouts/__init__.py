"""Parallel layouts as strategies: how one process group holds the model and runs it.

The trainer talks to one `Layout` (base.py) and never branches on the layout or reads the topology:
- `Replicated` (replicated.py): one process, data parallelism, sharding stage 1/2 and tensor parallelism:
  every rank runs whole micro-batches through its (possibly tensor-split) model;
- `Partitioned` (partitioned.py): sharding stage 3, the same with every parameter partitioned over the sharding
  group, each layer gathered for its forward and backward;
- `MicroBatching` (micro.py): micro-batches by rows or by a token budget, padded to their own longest or packed;
- `Pipelined` (pipelined.py): consecutive layer ranges on the stages of a pipeline, 1F1B schedule (with
  `virtual_pp_degree` k, k interleaved chunks per stage on the interleaved schedule);
- the rollout (rollout.py) decodes on the training model itself or on a copy resharded to
  `rollout_tensor_parallel_degree` (a pipeline rolls out on a gathered copy).
"""
from ..parallel.topology import Topology, single_process
from .base import BatchGroup, Layout
from .micro import MicroBatching
from .partitioned import Partitioned
from .pipelined import Pipelined
from .replicated import Replicated


def build_layout(topo: Topology = None, share_prompts: bool = True, max_tokens: int = 0,
                 remove_padding: bool = False) -> Layout:
    """`share_prompts`, `max_tokens` (a token budget per micro-batch, 0: rows) and `remove_padding` (packed
    micro-batches) choose how micro-batches are formed and run (micro.py)."""
    topo = topo or single_process()
    if topo.pp_degree > 1:
        cls = Pipelined
    elif topo.sharding_stage == 3 and topo.sharding_degree > 1:
        cls = Partitioned
    else:
        cls = Replicated
    return cls(topo, share_prompts, max_tokens, remove_padding)


__all__ = ["Layout", "BatchGroup", "MicroBatching", "Replicated", "Partitioned", "Pipelined", "build_layout"]
