"""The process grid: data x sharding x pipeline x context x tensor, and one communication group per axis.

Rank r has coordinates (data, sharding, pipe, context, tensor), tensor varying fastest:
    r = (((data * S + sharding) * P + pipe) * C + context) * T + tensor
so tensor-parallel peers are neighbours (one node, the fastest links on GPUs), context-parallel ones next.

Groups (a paddle.distributed group, or None for an axis of size 1, where every collective is a no-op):
- tp:       same (data, sharding, pipe), different tensor rank: split layers
- pp:       same (data, sharding, tensor), different stage: send/recv activations
- sharding: same (data, pipe, tensor): split the batch and the optimizer states
- dp:       same (sharding, pipe, tensor): split the batch, replicate the optimizer
- batch:    same (pipe, tensor): every rank holding a different part of the batch (dp x sharding); gradient
            and statistics sums run over it
- cp:       same (data, sharding, pipe, tensor), different context rank: the ranks that split every sequence's
            tokens (Ulysses, `context_parallel_degree`; parallel/collectives.py ContextSplit); they hold the same
            rows, and their gradients are summed as a data-parallel group's
- model:    same (data, sharding): the ranks that hold one copy of the model and the same data
            (pipe x context x tensor)
- embed:    first and last stage of a pipeline (tied input / output embedding)
- pp_next / pp_prev: this stage and its next / previous one on the ring of a pipeline's stages (the last
            stage's next is the first), for their send/recv, with more than 2 stages (with 2, the default group)
- rollout:  `rollout_tensor_parallel_degree` consecutive ranks that decode together (pipeline degree 1)

`sequence_parallel` rides on the tensor axis (its group splits the tokens of the activations between the
tensor-parallel blocks: parallel/collectives.py TokenSplit), so it needs a tensor degree above 1.

`paddle.distributed.new_group` is collective: every rank creates every group in the same order.
"""
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..config.parallel_args import STAGE3_AT_DEGREE_1, context_parallel_refusal, sequence_parallel_refusal
from . import watchdog
from .watchdog import watched

logger = logging.getLogger("paddle_rl")

AXES = ("data", "sharding", "pipe", "context", "tensor")
DEGREE_KEYS = {"data": "data_parallel_degree", "sharding": "sharding_parallel_degree",
               "pipe": "pipeline_parallel_degree", "context": "context_parallel_degree",
               "tensor": "tensor_parallel_degree"}


class TopologyError(ValueError):
    pass


def world_size_from_env() -> int:
    return int(os.environ.get("PADDLE_TRAINERS_NUM", os.environ.get("WORLD_SIZE", "1")) or 1)


def resolve_degrees(tensor: int = 1, pipe: int = 1, sharding: int = 1, data: int = -1,
                    world_size: Optional[int] = None, context: int = 1) -> Dict[str, int]:
    """Degrees per axis; -1 derives a degree from the world size (the processes launched). Errors name the keys.

    - sharding -1 (PaddleNLP's `sharding_parallel_degree: -1`) takes every rank that tensor x pipeline leave,
      divided by data_parallel_degree when that is given (>= 1). With data -1 as well, sharding is derived
      first and takes them all, so data is 1: PaddleNLP resolves sharding -1 before it derives the data degree
      from what is left. (config/parallel_args.py turns -1 into 1 when no sharding stage is named.)
    - data -1 takes what tensor x pipeline x sharding (x context) leave.
    The result names the context axis only when its degree is above 1 (a grid without it reads as before).
    """
    world = world_size_from_env() if world_size is None else world_size
    ctx_named = f" x context_parallel_degree ({context})" if context > 1 else ""
    if sharding == -1:
        rest = tensor * pipe * context * (1 if data == -1 else data)
        rest_named = f"tensor_parallel_degree ({tensor}) x pipeline_parallel_degree ({pipe}){ctx_named}" + (
            "" if data == -1 else f" x data_parallel_degree ({data})")
        if world % rest:
            raise TopologyError(f"sharding_parallel_degree -1 takes the ranks that {rest_named} = {rest} leave, but "
                                f"{rest} does not divide the world size {world} (processes launched)")
        sharding = world // rest
    model = tensor * pipe * sharding * context
    named = (f"tensor_parallel_degree ({tensor}) x pipeline_parallel_degree ({pipe}) x "
             f"sharding_parallel_degree ({sharding}){ctx_named}")
    if data == -1:
        if world % model:
            raise TopologyError(f"{named} = {model} does not divide the world size {world} (processes launched); "
                                f"launch a multiple of {model} processes or lower the degrees")
        data = world // model
    elif data * model != world:
        raise TopologyError(f"data_parallel_degree ({data}) x {named} = {data * model} does not match the world "
                            f"size {world} (processes launched, e.g. --nproc_per_node)")
    degrees = {"data": data, "sharding": sharding, "pipe": pipe, "tensor": tensor}
    if context > 1:
        degrees["context"] = context
    return degrees


@dataclass
class Topology:
    degrees: Dict[str, int]
    rank: int = 0
    sharding_stage: int = 1
    rollout_tp: int = 1
    sequence_parallel: bool = False
    groups: Dict[str, object] = field(default_factory=dict)
    ranks_of: Dict[str, List[int]] = field(default_factory=dict)
    virtual_pp: int = 1      # chunks of layers per pipeline stage (virtual_pp_degree: the interleaved schedule)

    def __post_init__(self):
        self.degrees = dict(self.degrees)
        self.degrees.setdefault("context", 1)   # a grid named without the context axis has degree 1 there

    # ------------------------------------------------------------------ coordinates
    @property
    def world_size(self) -> int:
        size = 1
        for axis in AXES:
            size *= self.degrees[axis]
        return size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def coords(self, rank: Optional[int] = None) -> Dict[str, int]:
        rank = self.rank if rank is None else rank
        out = {}
        for axis in reversed(AXES):
            out[axis] = rank % self.degrees[axis]
            rank //= self.degrees[axis]
        if self.degrees["context"] == 1:
            del out["context"]   # coordinates read as before on a grid without context parallelism
        return out

    def rank_at(self, **coords) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.degrees[axis] + coords.get(axis, 0)
        return rank

    @property
    def tp_degree(self) -> int:
        return self.degrees["tensor"]

    @property
    def pp_degree(self) -> int:
        return self.degrees["pipe"]

    @property
    def sharding_degree(self) -> int:
        return self.degrees["sharding"]

    @property
    def dp_degree(self) -> int:
        return self.degrees["data"]

    @property
    def cp_degree(self) -> int:
        return self.degrees["context"]

    @property
    def tp_rank(self) -> int:
        return self.coords()["tensor"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pipe"]

    @property
    def sharding_rank(self) -> int:
        return self.coords()["sharding"]

    @property
    def batch_degree(self) -> int:
        """Ranks holding different parts of the batch: data x sharding."""
        return self.degrees["data"] * self.degrees["sharding"]

    @property
    def batch_rank(self) -> int:
        c = self.coords()
        return c["data"] * self.degrees["sharding"] + c["sharding"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_degree - 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def group(self, name: str):
        return self.groups.get(name)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: data {self.degrees['data']} x sharding "
                f"{self.degrees['sharding']} (stage{self.sharding_stage}) x pipeline {self.degrees['pipe']}"
                f"{f' (virtual {self.virtual_pp})' if self.virtual_pp > 1 else ''}"
                f"{f' x context {self.cp_degree}' if self.cp_degree > 1 else ''} x tensor "
                f"{self.degrees['tensor']}{' (sequence parallel)' if self.sequence_parallel else ''}; rollout tensor "
                f"{self.rollout_tp}; coords {self.coords()}")

    # ------------------------------------------------------------------ group membership
    def axis_ranks(self, axes: Tuple[str, ...], rank: Optional[int] = None) -> List[int]:
        """Ranks that share every coordinate of `rank` except those on `axes` (in rank order)."""
        base = self.coords(rank)
        out = []
        for r in range(self.world_size):
            c = self.coords(r)
            if all(c.get(a, 0) == base.get(a, 0) for a in AXES if a not in axes):
                out.append(r)
        return out

    def rollout_ranks(self, rank: Optional[int] = None) -> List[int]:
        rank = self.rank if rank is None else rank
        start = rank // self.rollout_tp * self.rollout_tp
        return list(range(start, start + self.rollout_tp))


GROUP_AXES = {"tp": ("tensor",), "pp": ("pipe",), "sharding": ("sharding",), "dp": ("data",),
              "batch": ("data", "sharding"), "model": ("pipe", "context", "tensor"), "world": AXES,
              "cp": ("context",)}

_GROUP_CACHE: Dict[Tuple[int, ...], object] = {}
_INITIALIZED = False


def _new_group(ranks: Tuple[int, ...]):
    import paddle.distributed as dist
    if ranks not in _GROUP_CACHE:
        if len(ranks) == dist.get_world_size():
            # the whole world is the default group (a second gloo group over every rank intermittently failed
            # to connect on paddle 3.3.1)
            _GROUP_CACHE[ranks] = dist.get_group(0)
        else:
            with watched(f"new_group {list(ranks)}"):
                _GROUP_CACHE[ranks] = dist.new_group(list(ranks))
            # members connect while other ranks may already be creating the next group; without this barrier
            # overlapping groups on 4 processes hung or refused connections (gloo, paddle 3.3.1)
            with watched("barrier after new_group"):
                dist.barrier()
    return _GROUP_CACHE[ranks]


def build_topology(tensor: int = 1, pipe: int = 1, sharding: int = 1, data: int = -1, sharding_stage: str = "",
                   rollout_tensor: int = -1, collective_timeout: float = watchdog.DEFAULT_TIMEOUT,
                   sequence_parallel: bool = False, virtual_pp: int = 1, context: int = 1) -> Topology:
    """Initialize paddle.distributed (once per process), start this rank's watchdog (parallel/watchdog.py: a
    collective pending for more than `collective_timeout` seconds, or a dead peer, stops the rank with a message)
    and create every group of this grid.

    A single process with every degree 1 gets a topology without groups and without initializing anything.
    `virtual_pp` (virtual_pp_degree) chunks of layers per pipeline stage need a pipeline (pipe > 1).
    `sequence_parallel` splits the tensor group's activations along the tokens (tensor > 1, pipeline 1).
    `context` (context_parallel_degree) ranks split every sequence's tokens (Ulysses: tensor, pipeline 1, no stage3).
    """
    global _INITIALIZED
    if context > 1:
        refusal = context_parallel_refusal(tensor, pipe, sharding_stage if sharding != 1 else "", rollout_tensor)
        if refusal:
            raise TopologyError(refusal)
    degrees = resolve_degrees(tensor, pipe, sharding, data, context=context)
    degrees.setdefault("context", 1)
    if sequence_parallel and (tensor == 1 or pipe > 1):
        raise TopologyError(sequence_parallel_refusal(tensor, pipe))
    stage = {"": 1, "stage1": 1, "stage2": 2, "stage3": 3}.get(sharding_stage)
    if stage is None:
        raise TopologyError(f"sharding: {sharding_stage!r} is not supported (stage1 | stage2 | stage3)")
    if stage == 3 and degrees["sharding"] == 1:
        raise TopologyError(STAGE3_AT_DEGREE_1)
    if stage == 3 and pipe > 1:
        raise TopologyError("sharding: stage3 with pipeline_parallel_degree > 1 is not implemented (each stage "
                            "already holds only its layers); use stage2 with a pipeline")
    if virtual_pp > 1 and pipe == 1:
        raise TopologyError(f"virtual_pp_degree {virtual_pp} needs pipeline_parallel_degree > 1 (it splits each "
                            "pipeline stage into chunks of layers)")
    rollout_tp = tensor if rollout_tensor == -1 else rollout_tensor
    world = degrees["data"] * degrees["sharding"] * degrees["pipe"] * degrees["context"] * degrees["tensor"]
    if world % rollout_tp:
        raise TopologyError(f"rollout_tensor_parallel_degree ({rollout_tp}) does not divide the world size {world}")
    if rollout_tp != tensor and pipe > 1:
        raise TopologyError("rollout_tensor_parallel_degree different from tensor_parallel_degree needs "
                            "pipeline_parallel_degree 1 (the pipeline rolls out on a gathered copy)")
    if rollout_tp > tensor and (rollout_tp % tensor or (degrees["data"] * degrees["sharding"] * tensor) % rollout_tp):
        raise TopologyError(f"rollout_tensor_parallel_degree ({rollout_tp}) must be a multiple of "
                            f"tensor_parallel_degree ({tensor}) that divides data x sharding x tensor")
    if rollout_tp < tensor and tensor % rollout_tp:
        raise TopologyError(f"rollout_tensor_parallel_degree ({rollout_tp}) must divide tensor_parallel_degree "
                            f"({tensor})")
    if world == 1:
        single = Topology(degrees, 0, stage, rollout_tp, sequence_parallel)
        single.virtual_pp = virtual_pp
        return single
    import paddle.distributed as dist
    if not _INITIALIZED:
        if not dist.is_initialized():
            dist.init_parallel_env()
        _INITIALIZED = True
    watchdog.start(dist.get_rank(), dist.get_world_size(), collective_timeout)
    if dist.get_world_size() != world:
        raise TopologyError(f"{_product_text(degrees)} = {world} does not match the world size "
                            f"{dist.get_world_size()}")
    topo = Topology(degrees, dist.get_rank(), stage, rollout_tp, sequence_parallel)
    names = dict(GROUP_AXES)
    for name, axes in names.items():
        size = 1
        for a in axes:
            size *= degrees[a]
        seen = []
        for r in range(world):  # every rank creates every group, in the same order
            ranks = tuple(topo.axis_ranks(axes, r))
            if ranks not in seen:
                seen.append(ranks)
                group = _new_group(ranks) if size > 1 else None
                if topo.rank in ranks:
                    topo.groups[name] = group
                    topo.ranks_of[name] = list(ranks)
    if degrees["pipe"] > 1:  # first and last stage of each pipeline: the two copies of a tied embedding
        last = degrees["pipe"] - 1
        for r in range(world):
            c = topo.coords(r)
            if c["pipe"] != 0:
                continue
            ranks = (r, topo.rank_at(**dict(c, pipe=last)))
            group = _new_group(ranks)
            if topo.rank in ranks:
                topo.groups["embed"] = group
                topo.ranks_of["embed"] = list(ranks)
    if degrees["pipe"] > 2:  # each pair of neighbours on the ring of stages
        for r in range(world):
            c = topo.coords(r)
            ranks = (r, topo.rank_at(**dict(c, pipe=(c["pipe"] + 1) % degrees["pipe"])))
            group = _new_group(tuple(sorted(ranks)))
            if topo.rank == ranks[0]:
                topo.groups["pp_next"] = group
            if topo.rank == ranks[1]:
                topo.groups["pp_prev"] = group
    topo.virtual_pp = virtual_pp
    if rollout_tp > 1 and rollout_tp != tensor:
        for start in range(0, world, rollout_tp):
            ranks = tuple(range(start, start + rollout_tp))
            group = _new_group(ranks)
            if topo.rank in ranks:
                topo.groups["rollout"] = group
                topo.ranks_of["rollout"] = list(ranks)
    elif rollout_tp == tensor:
        topo.groups["rollout"] = topo.groups.get("tp")
        topo.ranks_of["rollout"] = topo.ranks_of.get("tp", [topo.rank])
    else:
        topo.groups["rollout"] = None
        topo.ranks_of["rollout"] = [topo.rank]
    logger.info("topology: %s", topo.describe())
    return topo


def _product_text(degrees: Dict[str, int]) -> str:
    return " x ".join(f"{DEGREE_KEYS[a]} ({degrees[a]})" for a in AXES if a != "context" or degrees[a] > 1)


def topology_from_config(config) -> Topology:
    return build_topology(tensor=config.tensor_parallel_degree, pipe=config.pipeline_parallel_degree,
                          sharding=config.sharding_parallel_degree, data=config.data_parallel_degree,
                          sharding_stage=config.sharding if config.sharding_parallel_degree != 1 else "",
                          rollout_tensor=config.rollout_tensor_parallel_degree,
                          collective_timeout=config.collective_timeout,
                          virtual_pp=config.virtual_pp_degree, sequence_parallel=config.sequence_parallel,
                          context=config.context_parallel_degree)


def single_process() -> Topology:
    return Topology({"data": 1, "sharding": 1, "pipe": 1, "tensor": 1})
