"""Differentiable collectives on paddle.distributed's public API (gloo on CPU, NCCL on GPU).

Tensor parallelism needs four conjugate pairs (forward / backward):
- copy_to_group:     identity       / all-reduce sum   (input of a column-parallel layer)
- reduce_from_group: all-reduce sum / identity         (output of a row-parallel layer, vocab sums)
- gather_from_group: all-gather     / take own slice   (full logits for sampling)
- scatter_to_group:  take own slice / all-gather
Every function is the identity when `group` is None (an axis of size 1). Every blocking call runs inside
`watchdog.watched`, so a rank waiting for a dead or stuck peer stops with a message (parallel/watchdog.py).
"""
from typing import List

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from .watchdog import watched


def group_size(group) -> int:
    return 1 if group is None else group.nranks


def group_rank(group) -> int:
    return 0 if group is None else group.rank


def _all_reduce(x, group, op=None):
    out = x.clone()
    with watched("all_reduce", group):
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out


def _all_gather_last(x, group):
    parts: List[paddle.Tensor] = []
    with watched("all_gather", group):
        dist.all_gather(parts, x.contiguous() if hasattr(x, "contiguous") else x, group=group)
    return paddle.concat(parts, axis=-1)


def _own_slice_last(x, group):
    size = x.shape[-1] // group.nranks
    start = group.rank * size
    return paddle.slice(x, axes=[x.ndim - 1], starts=[start], ends=[start + size]).clone()


class _CopyToGroup(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group)


class _ReduceFromGroup(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class _GatherFromGroup(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice_last(grad, ctx.group)


class _ScatterToGroup(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group)


def copy_to_group(x, group):
    return x if group is None else _CopyToGroup.apply(x, group)


def reduce_from_group(x, group):
    return x if group is None else _ReduceFromGroup.apply(x, group)


def gather_from_group(x, group):
    return x if group is None else _GatherFromGroup.apply(x, group)


def scatter_to_group(x, group):
    return x if group is None else _ScatterToGroup.apply(x, group)


@paddle.no_grad()
def all_reduce_max(x, group):
    """Element-wise max over the group (no gradient: used for numerically safe softmax shifts)."""
    return x if group is None else _all_reduce(x.detach(), group, dist.ReduceOp.MAX)


# ---------------------------------------------------------------------- numpy helpers (metrics, counts)

def sum_numpy(values, group) -> np.ndarray:
    """float64 sum of a small vector over the group."""
    values = np.asarray(values, dtype=np.float64)
    if group is None:
        return values
    tensor = paddle.to_tensor(values.reshape(-1), dtype="float64")
    with watched("all_reduce (sum)", group):
        dist.all_reduce(tensor, group=group)
    return tensor.numpy().reshape(values.shape)


def max_numpy(values, group) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if group is None:
        return values
    tensor = paddle.to_tensor(values.reshape(-1), dtype="float64")
    with watched("all_reduce (max)", group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.numpy().reshape(values.shape)


def gather_objects(obj, group) -> list:
    """Python objects of every rank of the group, in group-rank order."""
    if group is None:
        return [obj]
    out: list = []
    with watched("all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src_rank: int, group):
    """`obj` of global rank `src_rank` on every rank of the group."""
    if group is None:
        return obj
    objs = gather_objects(obj if dist.get_rank() == src_rank else None, group)
    return objs[group.ranks.index(src_rank)] if hasattr(group, "ranks") else next(o for o in objs if o is not None)


def barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        with watched("barrier", group):
            dist.barrier(group)


def is_distributed(param) -> bool:
    """True for a parameter split across the tensor-parallel group (each rank holds a different shard)."""
    return bool(getattr(param, "is_distributed", False))
