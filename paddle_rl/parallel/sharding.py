"""Gradient synchronization, the global gradient norm, and the sharded (ZeRO stage 1 / 2) optimizer.

Gradients are summed (not averaged): the loss of every rank is already its share of the global
mini-batch loss (global token / sequence normalizers), so the sum is the single-process gradient.

- context parallelism first (`context_parallel_degree`): every gradient all-reduced over the context group, whose
  ranks computed it from their own token slices (as a data-parallel group from its rows);
- no sharding / stage1: all-reduce every gradient over the batch group (data x sharding);
  stage1 then lets each sharding rank update only the parameters it owns (its Adam moments only)
  and broadcasts the updated values from the owners.
- stage2: each gradient is reduced to its owner inside the sharding group (and all-reduced over the
  data axis); the other ranks drop it, so gradients and optimizer states are both partitioned.

Collectives are coalesced into flat buckets (one call per bucket instead of one per tensor).
"""
from typing import Dict, List

import numpy as np
import paddle
import paddle.distributed as dist

from .. import optim
from .collectives import is_distributed, sum_gradients, sum_numpy
from .watchdog import watched

BUCKET_BYTES = 32 * 1024**2


def _buckets(params: List, limit: int = BUCKET_BYTES) -> List[List]:
    out, current, size = [], [], 0
    for p in params:
        nbytes = int(np.prod(p.shape)) * 4
        if current and size + nbytes > limit:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


@paddle.no_grad()
def _coalesced(params: List, collective) -> None:
    """Run `collective(flat)` on the concatenated gradients of params, then write the result back."""
    for bucket in _buckets(params):
        grads = [p.grad for p in bucket]
        flat = paddle.concat([g.reshape([-1]).astype("float32") for g in grads])
        collective(flat)
        offset = 0
        for g in grads:
            n = int(np.prod(g.shape))
            paddle.assign(flat[offset:offset + n].reshape(g.shape).astype(g.dtype), output=g)
            g.stop_gradient = True
            offset += n


def _reduce(flat, owner: int, group) -> None:
    with watched(f"reduce of gradients to rank {owner}", group):
        dist.reduce(flat, dst=owner, group=group)


def _all_reduce(flat, group) -> None:
    with watched("all_reduce of gradients", group):
        dist.all_reduce(flat, group=group)


def partition_params(params: List, n: int) -> List[int]:
    """Owner (sharding rank) of each parameter: greedy, largest first, ties to the lower rank (deterministic)."""
    sizes = [int(np.prod(p.shape)) for p in params]
    load = [0] * n
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class GradientSync:
    """Sums gradients over the batch group (reduced to owners under stage2) and measures the global norm.
    `token_partial`: parameters every tensor-parallel rank holds whole but whose gradient each computes in part (the
    q/k norms over its heads; sequence parallelism's norms over its tokens: CausalLM.tensor_partial_parameters),
    summed over the tensor-parallel group first."""

    def __init__(self, topo, params: List, token_partial: List = ()):
        self.topo = topo
        self.params = [p for p in params if not p.stop_gradient]
        self.token_partial = [p for p in token_partial if not p.stop_gradient]
        self.stage = topo.sharding_stage if topo.sharding_degree > 1 else 0
        self.owner = partition_params(self.params, topo.sharding_degree)
        ranks = topo.ranks_of.get("sharding", [topo.rank])
        self.owner_rank = [ranks[o] for o in self.owner]  # global rank of each parameter's owner

    def owned(self, param_index: int) -> bool:
        return self.stage == 0 or self.owner[param_index] == self.topo.sharding_rank

    @property
    def owned_params(self) -> List:
        return [p for i, p in enumerate(self.params) if self.owned(i)]

    def sync(self) -> None:
        topo = self.topo
        sum_gradients(self.token_partial, topo.group("tp"))
        # every rank of the batch group holds the same parameter list and each took part in the loss
        params = [p for p in self.params if p.grad is not None]
        if topo.group("cp") is not None and params:  # each context rank's gradient is its tokens' share
            _coalesced(params, lambda flat: _all_reduce(flat, topo.group("cp")))
        if topo.batch_degree == 1 or not params:
            return
        if self.stage == 2:
            group = topo.group("sharding")
            for owner in sorted(set(self.owner_rank)):
                mine = [p for p, o in zip(self.params, self.owner_rank) if o == owner and p.grad is not None]
                _coalesced(mine, lambda flat, o=owner: _reduce(flat, o, group))
            owned = [p for p in self.owned_params if p.grad is not None]
            for i, p in enumerate(self.params):
                if not self.owned(i):
                    p.clear_gradient(False)  # stage2: only the owner keeps a gradient
            if topo.group("dp") is not None:
                _coalesced(owned, lambda flat: _all_reduce(flat, topo.group("dp")))
        else:
            group = topo.group("batch")
            _coalesced(params, lambda flat: _all_reduce(flat, group))

    def squared_norm(self) -> float:
        """Squared global L2 norm of the (synchronized) gradient: each element counted once."""
        topo = self.topo
        local = [p for i, p in enumerate(self.params) if p.grad is not None and (self.stage != 2 or self.owned(i))
                 and not getattr(p, "pp_duplicate", False)]
        split = sum(float(paddle.sum(p.grad.astype("float32").square())) for p in local if is_distributed(p))
        whole = sum(float(paddle.sum(p.grad.astype("float32").square())) for p in local if not is_distributed(p))
        if topo.tp_degree > 1:
            split = float(sum_numpy([split], topo.group("tp"))[0])
        total = split + whole
        if self.stage == 2:
            total = float(sum_numpy([total], topo.group("sharding"))[0])
        if topo.pp_degree > 1:
            total = float(sum_numpy([total], topo.group("pp"))[0])
        return total

    def clip_(self, max_norm: float) -> float:
        """Sum the gradients over ranks, then scale them so the global norm is at most max_norm; returns the norm."""
        self.sync()
        norm = float(np.sqrt(self.squared_norm()))
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            with paddle.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.stop_gradient = True  # grads written by collectives may carry the flag
                        p.grad.scale_(scale)
        return norm


class ShardedOptimizer:
    """An optimizer over this rank's parameter shard, broadcasting updated parameters from their owners.

    Looks like a paddle optimizer to the trainer (step, clear_grad, get_lr, state_dict, set_state_dict).
    """

    def __init__(self, inner, sync: GradientSync):
        self.inner = inner
        self.sync = sync

    def step(self) -> None:
        self.inner.step()
        topo = self.sync.topo
        group = topo.group("sharding")
        if group is None:
            return
        with paddle.no_grad():
            for owner in sorted(set(self.sync.owner_rank)):
                mine = [p for p, o in zip(self.sync.params, self.sync.owner_rank) if o == owner]
                for bucket in _buckets(mine):
                    flat = paddle.concat([p.reshape([-1]) for p in bucket])
                    with watched(f"broadcast of updated parameters from rank {owner}", group):
                        dist.broadcast(flat, src=owner, group=group)
                    offset = 0
                    for p in bucket:
                        n = int(np.prod(p.shape))
                        p.set_value(flat[offset:offset + n].reshape(p.shape))
                        offset += n

    def clear_grad(self, set_to_zero: bool = True) -> None:
        for p in self.sync.params:
            p.clear_gradient(set_to_zero)

    def get_lr(self) -> float:
        return self.inner.get_lr()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def set_state_dict(self, state: dict) -> None:
        self.inner.set_state_dict(state)


def optimizer_state_bytes(optimizer) -> Dict[str, int]:
    """Bytes of optimizer state this rank holds: {'moments': Adam moment1 + moment2, 'total': every accumulator}."""
    inner = getattr(optimizer, "inner", optimizer)
    moments = total = 0
    for name, tensors in getattr(inner, "_accumulators", {}).items():
        nbytes = sum(int(np.prod(t.shape)) * t.element_size() for t in tensors.values())
        total += nbytes
        if name.startswith("moment"):
            moments += nbytes
    return {"moments": moments, "total": total}


def build_sharded_optimizer(model, config, total_steps: int, sync: GradientSync,
                            build_optimizer=None):
    """(optimizer, scheduler): AdamW over every parameter, or over this rank's shard under sharding."""
    if build_optimizer is None:
        build_optimizer = optim.build_optimizer
    if sync.stage == 0:
        return build_optimizer(model, config, total_steps)
    inner, scheduler = build_optimizer(model, config, total_steps, parameters=sync.owned_params)
    return ShardedOptimizer(inner, sync), scheduler

