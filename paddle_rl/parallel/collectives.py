"""Differentiable collectives on paddle.distributed's public API (gloo on CPU, NCCL on GPU).

Tensor parallelism needs four conjugate pairs (forward / backward):
- copy_to_group:     identity       / all-reduce sum   (input of a column-parallel layer)
- reduce_from_group: all-reduce sum / identity         (output of a row-parallel layer, vocab sums)
- gather_from_group: all-gather     / take own slice   (full logits for sampling)
- scatter_to_group:  take own slice / all-gather
Every function is the identity when `group` is None (an axis of size 1). Every blocking call runs inside
`watchdog.watched`, so a rank waiting for a dead or stuck peer stops with a message (parallel/watchdog.py).

Sequence parallelism (Megatron's, `sequence_parallel: true`) splits the activations between the tensor-parallel
blocks along the token axis (axis 1 of [batch, tokens, hidden]): `TokenSplit` holds the group and the whole
token count, pads it to a multiple of the degree (the pad rows are zeros, cut off whenever the tokens are
whole again) and gives four more pairs:
- gather:         all-gather      / reduce-scatter  (input of a column-parallel layer: its gradient is partial)
- reduce_scatter: reduce-scatter  / all-gather      (output of a row-parallel layer, of the vocabulary embedding)
- whole:          all-gather      / take own tokens (into a replicated computation: the head, an MoE block)
- split:          take own tokens / all-gather      (out of a replicated computation)
gloo (the CPU backend) has no reduce-scatter: there it is an all-reduce and each rank keeps its own tokens (the
same values, twice the bytes on the wire); NCCL runs `dist.reduce_scatter`.

Context parallelism (Ulysses, `context_parallel_degree`): `ContextSplit` holds a rank's contiguous slice of a pass's
tokens through the whole decoder and gives the all-to-all pair around attention (tokens for heads, and back: each
the other's backward) and the sum of the head's per-rank outputs (identity backward). gloo has no all-to-all
either: there it is an all-gather, each rank keeping its chunk of every part; NCCL runs `dist.alltoall`.
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


# ---------------------------------------------------------------------- sequence parallelism (token axis)

def _pad_tokens(x, padded: int):
    """x [B, T, ...] with zero rows appended along axis 1 up to `padded` tokens."""
    missing = padded - x.shape[1]
    if not missing:
        return x
    return paddle.concat([x, paddle.zeros([x.shape[0], missing] + list(x.shape[2:]), x.dtype)], axis=1)


def _gather_tokens(x, split: "TokenSplit"):
    parts: List[paddle.Tensor] = []
    with watched("all_gather (sequence parallel)", split.group):
        dist.all_gather(parts, x.contiguous() if hasattr(x, "contiguous") else x, group=split.group)
    whole = paddle.concat(parts, axis=1)
    return whole if whole.shape[1] == split.total else whole[:, :split.total]


def _own_tokens(x, split: "TokenSplit"):
    x = _pad_tokens(x, split.padded)
    start = split.rank * split.local
    return x[:, start:start + split.local].clone()


def _reduce_scatter_tokens(x, split: "TokenSplit"):
    x = _pad_tokens(x, split.padded)
    if x.place.is_gpu_place():
        out = paddle.empty([x.shape[0], split.local] + list(x.shape[2:]), x.dtype)
        chunks = [c.contiguous() for c in paddle.split(x, split.size, axis=1)]
        with watched("reduce_scatter (sequence parallel)", split.group):
            dist.reduce_scatter(out, chunks, group=split.group)
        return out
    summed = x.clone()
    with watched("all_reduce (sequence parallel reduce-scatter)", split.group):  # gloo: no reduce-scatter
        dist.all_reduce(summed, group=split.group)
    start = split.rank * split.local
    return summed[:, start:start + split.local].clone()


class _GatherTokens(PyLayer):
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return _gather_tokens(x, split)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_tokens(grad, ctx.split)


class _ReduceScatterTokens(PyLayer):
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return _reduce_scatter_tokens(x, split)

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad, ctx.split)


class _WholeTokens(PyLayer):
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return _gather_tokens(x, split)

    @staticmethod
    def backward(ctx, grad):
        return _own_tokens(grad, ctx.split)


class _SplitTokens(PyLayer):
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return _own_tokens(x, split)

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad, ctx.split)


class _GatherMatmul(PyLayer):
    # Megatron's column-parallel product under sequence parallelism: only this rank's tokens are kept for the
    # backward, which all-gathers them again for the weight's gradient instead of keeping the gathered input
    @staticmethod
    def forward(ctx, x, weight, split):
        ctx.split = split
        ctx.save_for_backward(x, weight)
        return paddle.matmul(_gather_tokens(x, split), weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensor()
        grad_x = _reduce_scatter_tokens(paddle.matmul(grad, weight, transpose_y=True), ctx.split)
        if weight.stop_gradient:
            return grad_x, None
        whole = _gather_tokens(x, ctx.split)
        rows = whole.reshape([-1, whole.shape[-1]])
        return grad_x, paddle.matmul(rows, grad.reshape([-1, grad.shape[-1]]), transpose_x=True)


class TokenSplit:
    """The tokens of one pass split over a tensor-parallel group (sequence parallelism): `total` tokens along axis
    1, padded to `padded` (a multiple of the group's size), rank r holding tokens [r * local, (r + 1) * local).
    Pad rows enter as zeros and leave when the tokens are gathered (cut off), so they reach no attention, no head
    and no parameter's gradient."""

    def __init__(self, group, total: int, keep_own: bool = True):
        self.group = group
        self.keep_own = keep_own  # gather_matmul may keep only this rank's tokens for the backward
        self.size, self.rank = group_size(group), group_rank(group)
        self.total = total
        self.local = -(-total // self.size)
        self.padded = self.local * self.size

    def gather(self, x):
        """Own tokens -> all of them, for a column-parallel layer (backward: reduce-scatter of its partial
        gradients)."""
        return _GatherTokens.apply(x, self)

    def gather_matmul(self, x, weight):
        """gather(x) @ weight [K, N] keeping only x (this rank's tokens) for the backward, which gathers them again
        for the weight's gradient (float32 products)."""
        return _GatherMatmul.apply(x, weight, self)

    def reduce_scatter(self, x):
        """Partial sums over all tokens -> the summed own tokens (a row-parallel layer's output; backward:
        all-gather)."""
        return _ReduceScatterTokens.apply(x, self)

    def whole(self, x):
        """Own tokens -> all of them, into a computation every rank repeats (backward: own tokens of its whole
        gradient)."""
        return _WholeTokens.apply(x, self)

    def split(self, x):
        """All tokens (the same on every rank) -> own tokens (backward: all-gather)."""
        return _SplitTokens.apply(x, self)


@paddle.no_grad()
def sum_gradients(params, group) -> None:
    """Sum the gradients of `params` over `group` in place (one all-reduce of them all): parameters every rank
    holds whole but applies to its own tokens only (sequence parallelism's norms)."""
    params = [p for p in params if p.grad is not None]
    if group is None or not params:
        return
    flat = paddle.concat([p.grad.reshape([-1]).astype("float32") for p in params])
    with watched("all_reduce of sequence-parallel gradients", group):
        dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = int(np.prod(p.grad.shape))
        paddle.assign(flat[offset:offset + n].reshape(p.grad.shape).astype(p.grad.dtype), output=p.grad)
        offset += n


# ---------------------------------------------------------------------- context parallelism (Ulysses)

def _all_to_all(x, split_axis: int, concat_axis: int, group):
    """x split into group.nranks chunks along `split_axis`; rank r's result is chunk r of every rank's x, concatenated
    along `concat_axis` in rank order. NCCL: one `dist.alltoall`. gloo (the CPU backend) has no all-to-all (Paddle
    3.3.1: "ProcessGroupGLOO does not support all_to_all"): an all-gather of the whole x, each rank keeping its chunk
    of every part (the same result, group.nranks times the bytes on the wire)."""
    size = group.nranks
    if x.place.is_gpu_place():
        chunks = [c.contiguous() for c in paddle.split(x, size, axis=split_axis)]
        parts: List[paddle.Tensor] = []
        with watched("all_to_all (context parallel)", group):
            dist.alltoall(parts, chunks, group=group)
    else:
        gathered: List[paddle.Tensor] = []
        with watched("all_gather (context parallel all-to-all)", group):
            dist.all_gather(gathered, x.contiguous() if hasattr(x, "contiguous") else x, group=group)
        parts = [paddle.split(g, size, axis=split_axis)[group.rank] for g in gathered]
    return paddle.concat(parts, axis=concat_axis)


class _TokensToHeads(PyLayer):
    # [B, local tokens, heads, d] -> [B, padded tokens, heads / size, d]; backward: the inverse all-to-all
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return _all_to_all(x, 2, 1, split.group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, 1, 2, ctx.split.group)


class _HeadsToTokens(PyLayer):
    # [B, padded tokens, heads / size, d] -> [B, local tokens, heads, d]; backward: the inverse all-to-all
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return _all_to_all(x, 1, 2, split.group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, 2, 1, ctx.split.group)


class ContextSplit:
    """The tokens of one pass split over a context-parallel group (Ulysses sequence parallelism,
    `context_parallel_degree`): `total` tokens along axis 1, padded to `padded` (a multiple of the group's size),
    rank r holding the contiguous tokens [r * local, (r + 1) * local) through the whole decoder: embedding, norms,
    projections, MLP, the head. Around each attention core an all-to-all turns [tokens / size, all heads] into
    [all tokens, heads / size] (`to_heads`) and back (`to_tokens`): attention runs on whole sequences for this rank's
    heads. Pad tokens (the last rank's tail) reach no attention (cut off before it) and no log-prob."""

    def __init__(self, group, total: int):
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.total = total
        self.local = -(-total // self.size)
        self.padded = self.local * self.size
        self.start = self.rank * self.local

    def own(self, x):
        """x [B, total, ...] (ids, positions; the same on every rank) -> this rank's tokens [B, local, ...] (pad rows
        zeros)."""
        return _pad_tokens(x, self.padded)[:, self.start:self.start + self.local]

    def to_heads(self, x):
        """[B, local, heads, d] -> [B, total, heads / size, d] (the all-to-all before attention)."""
        whole = _TokensToHeads.apply(x, self)
        return whole if self.padded == self.total else whole[:, :self.total]

    def to_tokens(self, x):
        """[B, total, heads / size, d] -> [B, local, heads, d] (the all-to-all after attention)."""
        return _HeadsToTokens.apply(_pad_tokens(x, self.padded), self)

    def owned(self, positions: np.ndarray) -> np.ndarray:
        """Which of `positions` (token indices along axis 1) this rank holds."""
        positions = np.asarray(positions)
        return (positions >= self.start) & (positions < min(self.start + self.local, self.total))

    def sum(self, x):
        """Every rank's values summed (each rank filled its own positions, zeros elsewhere); backward: the identity,
        so each rank's positions take the gradient of the one loss every rank computes from the sum."""
        return reduce_from_group(x, self.group)

    @paddle.no_grad()
    def sum_ints(self, x):
        out = x.clone()
        with watched("all_reduce (context parallel)", self.group):
            dist.all_reduce(out, group=self.group)
        return out
