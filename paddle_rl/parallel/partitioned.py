"""Sharding stage 3 (ZeRO-3): every parameter partitioned over the sharding group, each decoder layer gathered
for its forward and again for its backward and freed after, gradients reduce-scattered to their shards, the
optimizer over the shards (`sharding: stage3`, layouts/partitioned.py).
"""
import contextlib
from typing import Dict, List

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.base.framework import EagerParamBase

from .collectives import is_distributed, sum_numpy
from .watchdog import watched


class _Part:
    """One parameter under stage 3: the model's parameter (its storage freed while it is not gathered), its flat
    size and this rank's slice of the flattened, zero-padded tensor (`shard`: a parameter of its own, with the full
    parameter's name, which the optimizer updates; `grad`: the slice's summed gradient)."""
    __slots__ = ("param", "numel", "size", "shard", "grad")

    def __init__(self, param, degree: int, rank: int):
        self.param = param
        self.numel = int(np.prod(param.shape))
        self.size = -(-self.numel // degree)
        whole = param.numpy().reshape(-1)
        flat = np.zeros(self.size * degree, dtype=whole.dtype)
        flat[:self.numel] = whole
        self.shard = EagerParamBase(shape=[self.size], dtype=param.dtype, name=param.name,
                                    trainable=not param.stop_gradient)
        self.shard.set_value(flat[rank * self.size:(rank + 1) * self.size])
        self.shard.stop_gradient = param.stop_gradient
        for attr in ("is_distributed", "pp_duplicate"):
            if hasattr(param, attr):
                setattr(self.shard, attr, getattr(param, attr))
        self.grad = None


class _Unit:
    """Parameters gathered and freed together: one decoder layer, or the model's outer parameters (embedding,
    final norm, LM or value head). `holds`: how many passes or contexts need it gathered now."""

    def __init__(self, name: str, parts: List[_Part]):
        self.name = name
        self.parts = parts
        self.holds = 0


class _Gathered(PyLayer):
    """Identity on a unit's output; its backward (the start of the unit's backward) calls `enter`, which gathers
    the unit's parameters again."""

    @staticmethod
    def forward(ctx, x, enter):
        ctx.enter = enter
        return x

    @staticmethod
    def backward(ctx, dy):
        ctx.enter()
        return dy


class _Partitioned:
    """A model whose parameters are partitioned: its units in forward order (the outer one first)."""

    def __init__(self, model, units: List[_Unit]):
        self.model = model
        self.units = units
        self.pending = None   # the unit whose backward runs now (its gradient not yet reduce-scattered)


class PartitionedParams:
    """ZeRO stage 3 over the sharding group: each rank keeps 1/d of every parameter between passes.

    Partitioning is per tensor and flat: a parameter is flattened, zero-padded to a multiple of d, and rank r keeps
    elements [r * n/d, (r + 1) * n/d) (`_Part.shard`). Each decoder layer is a unit: a forward pre-hook all-gathers
    its parameters (over the sharding group) into the layer's own parameters just before its forward, a post-hook
    frees them after it; when gradients are on, the layer's output passes through `_Gathered`, whose backward
    gathers the layer again just before its backward; when the next unit's backward starts (or the backward ends)
    its gradients are reduce-scattered to their shards and it is freed first, so one layer is whole at a time.
    The outer parameters (embedding, final norm, LM head or value head: the head reads them outside a layer call)
    are gathered for a whole micro-batch pass, forward through backward. A rollout, a checkpoint or a resume
    gathers the whole model once (`gathered`) and frees it after.

    Every rank of the sharding group must run the same passes (the same number of micro-batches: the layout pads
    with idle passes) through the same layers in the same order: a unit's gather and reduce-scatter are collectives.
    gloo has no reduce-scatter: each rank's slice is reduced to it (`dist.reduce`, one call per rank, the same bytes
    a reduce-scatter moves)."""

    def __init__(self, topo):
        self.topo = topo
        self.group = topo.group("sharding")
        self.degree = topo.sharding_degree
        self.rank = topo.sharding_rank
        self.ranks = topo.ranks_of.get("sharding", [topo.rank])
        self._models: Dict[int, _Partitioned] = {}
        self.whole_bytes = 0        # bytes of parameters gathered whole right now (every partitioned model)
        self.peak_whole_bytes = 0   # the most at once, ever
        self.pass_peak_bytes = 0    # the most at once inside micro-batch passes (`running`)

    # ---------------------------------------------------------------- partitioning
    def partition(self, model) -> None:
        """Keep this rank's slice of every parameter of `model` (whole on every rank now) and free the rest; hook
        its decoder layers."""
        layers = list(getattr(model, "layers", []))
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        outer = [p for p in model.parameters() if id(p) not in in_layers]
        units = [_Unit("outer", [_Part(p, self.degree, self.rank) for p in outer])]
        for i, layer in enumerate(layers):
            unit = _Unit(f"layer {i}", [_Part(p, self.degree, self.rank) for p in layer.parameters()])
            units.append(unit)
            layer.register_forward_pre_hook(self._pre_hook(unit))
            layer.register_forward_post_hook(self._post_hook(model, unit))
        self._models[id(model)] = _Partitioned(model, units)
        for unit in units:
            for part in unit.parts:
                part.param._clear_data()

    def _state(self, model) -> _Partitioned:
        return self._models[id(model)]

    def is_partitioned(self, model) -> bool:
        return id(model) in self._models

    @paddle.no_grad()
    def repartition(self, model) -> None:
        """Take every shard from the model's whole parameters (inside `gathered`, after they were overwritten)."""
        for unit in self._state(model).units:
            for part in unit.parts:
                flat = part.param.reshape([-1])
                pad = part.size * self.degree - part.numel
                if pad:
                    flat = paddle.concat([flat, paddle.zeros([pad], dtype=flat.dtype)])
                part.shard.set_value(flat[self.rank * part.size:(self.rank + 1) * part.size])

    # ---------------------------------------------------------------- gather / free
    def _acquire(self, unit: _Unit) -> None:
        if unit.holds == 0:
            self._all_gather(unit)
        unit.holds += 1

    def _release(self, unit: _Unit) -> None:
        unit.holds -= 1
        if unit.holds == 0:
            self._free(unit)

    @paddle.no_grad()
    def _all_gather(self, unit: _Unit) -> None:
        if not unit.parts:
            return
        flat = paddle.concat([part.shard.detach().reshape([-1]) for part in unit.parts])
        pieces: List = []
        with watched(f"all_gather of the parameters of {unit.name}", self.group):
            dist.all_gather(pieces, flat, group=self.group)
        offset = 0
        for part in unit.parts:
            whole = paddle.concat([piece[offset:offset + part.size] for piece in pieces])[:part.numel]
            whole = whole.reshape(part.param.shape)
            part.param.get_tensor()._share_data_with(whole.get_tensor())
            offset += part.size
        self._count(unit, +1)

    def _count(self, unit: _Unit, sign: int) -> None:
        self.whole_bytes += sign * sum(part.numel * part.shard.element_size() for part in unit.parts)
        self.peak_whole_bytes = max(self.peak_whole_bytes, self.whole_bytes)

    def _free(self, unit: _Unit) -> None:
        self._count(unit, -1)
        for part in unit.parts:
            part.param._clear_data()

    @paddle.no_grad()
    def _reduce_scatter(self, unit: _Unit) -> None:
        """Sum the unit's gradients over the sharding group into their shards' gradients (`_Part.grad`, added to
        what earlier micro-batches left) and drop the whole gradients."""
        parts = [part for part in unit.parts if not part.param.stop_gradient]
        if not parts:
            return
        slices = [[] for _ in range(self.degree)]
        for part in parts:
            grad = part.param.grad
            flat = paddle.zeros([part.size * self.degree], dtype="float32")
            if grad is not None:
                flat[:part.numel] = grad.reshape([-1]).astype("float32")
            for k in range(self.degree):
                slices[k].append(flat[k * part.size:(k + 1) * part.size])
            part.param.clear_gradient(False)
        mine = None
        for k, owner in enumerate(self.ranks):
            chunk = paddle.concat(slices[k])
            with watched(f"reduce of the gradients of {unit.name} to rank {owner}", self.group):
                dist.reduce(chunk, dst=owner, group=self.group)
            if k == self.rank:
                mine = chunk
        offset = 0
        for part in parts:
            piece = mine[offset:offset + part.size]
            if part.grad is None:
                part.grad = piece
            else:
                part.grad.add_(piece)
            offset += part.size

    # ---------------------------------------------------------------- hooks
    def _pre_hook(self, unit: _Unit):
        def hook(layer, inputs):
            self._acquire(unit)
        return hook

    def _post_hook(self, model, unit: _Unit):
        def hook(layer, inputs, output):
            self._release(unit)
            if paddle.is_grad_enabled() and isinstance(output, paddle.Tensor) and not output.stop_gradient:
                return _Gathered.apply(output, lambda: self._enter_backward(model, unit))
            return None
        return hook

    def _enter_backward(self, model, unit: _Unit) -> None:
        state = self._state(model)
        self._finish(state)
        self._acquire(unit)
        state.pending = unit

    def _finish(self, state: _Partitioned) -> None:
        if state.pending is not None:
            unit, state.pending = state.pending, None
            self._reduce_scatter(unit)
            self._release(unit)

    # ---------------------------------------------------------------- passes and whole-model contexts
    @contextlib.contextmanager
    def running(self, model):
        """One micro-batch pass (forward, and backward when gradients are on): the outer parameters gathered
        throughout; on exit the gradients still whole (the last layers' backward, the outer ones) are
        reduce-scattered and every unit is free again."""
        state = self._state(model)
        outer = state.units[0]
        before, self.peak_whole_bytes = self.peak_whole_bytes, self.whole_bytes
        self._acquire(outer)
        try:
            yield
            self._finish(state)
            if paddle.is_grad_enabled():
                self._reduce_scatter(outer)
        finally:
            self._release(outer)
            self.pass_peak_bytes = max(self.pass_peak_bytes, self.peak_whole_bytes)
            self.peak_whole_bytes = max(before, self.peak_whole_bytes)

    @contextlib.contextmanager
    def gathered(self, model):
        """The whole model gathered on every rank (the rollout, a checkpoint, a resume), freed on exit (a model
        that is not partitioned, as a rollout's resharded copy, is whole already)."""
        if not self.is_partitioned(model):
            yield model
            return
        units = self._state(model).units
        for unit in units:
            self._acquire(unit)
        try:
            yield model
        finally:
            for unit in units:
                self._release(unit)

    def held_bytes(self, model) -> Dict[str, int]:
        """Bytes of the model's parameters this rank holds: {'shards': its slices, 'whole': parameters gathered at
        this moment (0 between passes), 'pass_peak_whole': the most gathered at once inside a micro-batch pass (of
        any partitioned model: the actor's, the reference's), 'peak_whole': the most ever (the rollout's whole
        model)}."""
        units = self._state(model).units
        shards = sum(part.size * part.shard.element_size() for unit in units for part in unit.parts)
        whole = sum(part.numel * part.param.element_size() for unit in units for part in unit.parts
                    if part.param._is_initialized())
        return {"shards": shards, "whole": whole, "pass_peak_whole": self.pass_peak_bytes,
                "peak_whole": self.peak_whole_bytes}

    # ---------------------------------------------------------------- gradients
    def grads(self, model) -> List:
        """(shard parameter, summed gradient slice or None) of every trained parameter."""
        return [(part.shard, part.grad) for unit in self._state(model).units for part in unit.parts
                if not part.shard.stop_gradient]

    def parts(self, model) -> List[_Part]:
        return [part for unit in self._state(model).units for part in unit.parts]

    @paddle.no_grad()
    def clear_grads(self, model, set_to_zero: bool = False) -> None:
        """Drop the shards' gradients, or zero them in place (`set_to_zero`: their memory kept, release_grads
        false). The whole gradients are dropped at each reduce-scatter either way."""
        for unit in self._state(model).units:
            for part in unit.parts:
                if set_to_zero and part.grad is not None:
                    part.grad.zero_()
                else:
                    part.grad = None


class PartitionedSync:
    """GradientSync's interface under stage 3: the shards' gradients (already reduce-scattered by the passes)
    all-reduced over the data axis, the global norm over the shards (each element once), clipping. `token_partial`:
    parameters whose gradients each tensor-parallel rank holds for its own tokens only (sequence parallelism's
    norms), their shards' gradients summed over the tensor-parallel group first (the same slice on every rank)."""

    stage = 3

    def __init__(self, topo, params: PartitionedParams, model, token_partial=()):
        self.topo = topo
        self.partitioned = params
        self.model = model
        self.token_partial = {id(p) for p in token_partial}

    @property
    def params(self) -> List:
        return [shard for shard, _ in self.partitioned.grads(self.model)]

    @property
    def owned_params(self) -> List:
        return self.params

    def sync(self) -> None:
        tp = self.topo.group("tp")
        partial = [part.grad for part in self.partitioned.parts(self.model)
                   if id(part.param) in self.token_partial and part.grad is not None]
        if tp is not None and partial:
            flat = paddle.concat([g.reshape([-1]) for g in partial])
            with watched("all_reduce of sequence-parallel gradient shards", tp):
                dist.all_reduce(flat, group=tp)
            offset = 0
            for g in partial:
                paddle.assign(flat[offset:offset + g.shape[0]], output=g)
                offset += g.shape[0]
        group = self.topo.group("dp")
        grads = [g for _, g in self.partitioned.grads(self.model) if g is not None]
        if group is None or not grads:
            return
        flat = paddle.concat([g.reshape([-1]) for g in grads])
        with watched("all_reduce of the gradient shards", group):
            dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            n = int(np.prod(g.shape))
            paddle.assign(flat[offset:offset + n].reshape(g.shape), output=g)
            offset += n

    def squared_norm(self) -> float:
        topo = self.topo
        split = whole = 0.0
        for shard, g in self.partitioned.grads(self.model):
            if g is None or getattr(shard, "pp_duplicate", False):
                continue
            value = float(paddle.sum(g.astype("float32").square()))
            if is_distributed(shard):
                split += value
            else:
                whole += value
        if topo.tp_degree > 1:
            split = float(sum_numpy([split], topo.group("tp"))[0])
        return float(sum_numpy([split + whole], topo.group("sharding"))[0])

    def clip_(self, max_norm: float) -> float:
        self.sync()
        norm = float(np.sqrt(self.squared_norm()))
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            with paddle.no_grad():
                for _, g in self.partitioned.grads(self.model):
                    if g is not None:
                        g.scale_(scale)
        return norm


class PartitionedOptimizer:
    """The optimizer over this rank's shards (stage 3): each step hands the shards their summed gradients, and the
    updated shards are what the next gather reads (no broadcast)."""

    def __init__(self, inner, sync: PartitionedSync):
        self.inner = inner
        self.sync = sync

    def step(self) -> None:
        with paddle.no_grad():
            for shard, g in self.sync.partitioned.grads(self.sync.model):
                shard.clear_gradient(False)
                if g is not None:
                    shard.grad = g
        self.inner.step()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        self.sync.partitioned.clear_grads(self.sync.model, set_to_zero)
        for shard in self.sync.params:
            shard.clear_gradient(set_to_zero)

    def get_lr(self) -> float:
        return self.inner.get_lr()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def set_state_dict(self, state: dict) -> None:
        self.inner.set_state_dict(state)
