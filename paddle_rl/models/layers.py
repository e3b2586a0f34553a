"""Layers that carry their own checkpoint mapping and tensor-parallel split.

Every parameter holds a `ParamSpec` (attribute `spec`): the Hugging Face tensors it is made of, whether it
is stored transposed (Paddle Linear weights are [in, out], HF ones [out, in]), and how it splits over the
tensor-parallel group. Loading, saving, resharding and gradient norms read these specs; no other file
lists parameter names.

Tensor parallelism (Megatron-style) on the differentiable collectives of parallel/collectives.py:
- ColumnLinear: weight [in, out/tp]. A fused projection lists its logical parts (q, k, v or gate, up);
  rank r holds [part_0 shard r, part_1 shard r, ...], so the local output splits like the full one. The
  input enters through copy_to_group (its gradient is all-reduced).
- RowLinear: weight [in/tp, out] on the rank's slice of the input features; partial outputs are
  all-reduced (bias added after the sum).
- VocabEmbedding: rows [r*Vp/tp, (r+1)*Vp/tp) of the table, the vocabulary padded up to Vp, a multiple of
  the degree (Megatron's padding): padded rows are zero, never looked up, and their logits are cut off
  before sampling and log-probs. Tokens outside a rank's rows give zeros; the group sums the lookups.
- Sequence parallelism (`tokens`, a collectives.TokenSplit, passed by the decoder): the layers' inputs and
  outputs outside the blocks hold this rank's tokens only. ColumnLinear all-gathers the tokens instead of the
  copy (backward: reduce-scatter; a float32 product keeps only its own tokens and gathers them again for the
  weight's gradient, as Megatron does), RowLinear and VocabEmbedding reduce-scatter instead of the all-reduce
  (backward: all-gather).
Without a group (one process) every layer is the plain single-device layer.
"""
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .. import ops
from ..parallel.collectives import (all_reduce_max, copy_to_group, group_rank, group_size, reduce_from_group)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter's place in a Hugging Face checkpoint and under tensor parallelism.

    hf_names: the HF tensors concatenated (along HF axis 0) into this parameter: q|k|v, gate|up, or one.
    transpose: stored as the transpose of the concatenation (Linear weights).
    axis: the local-layout axis split over the tensor-parallel group (None: replicated).
    parts: logical sizes along `axis`; each part is split separately, so a rank's shard of a fused
           projection is [q shard, k shard, v shard].
    pad: parts may be padded up to a multiple of the degree (the vocabulary); otherwise they must divide.
    """
    hf_names: Tuple[str, ...]
    transpose: bool = False
    axis: Optional[int] = None
    parts: Tuple[int, ...] = ()
    pad: bool = False

    # ---------------------------------------------------------------- checkpoint layout
    def from_hf(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """The full local-layout tensor; KeyError names a missing HF tensor."""
        arrays = []
        for name in self.hf_names:
            if name not in tensors:
                raise KeyError(name)
            arrays.append(tensors[name])
        full = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        return full.T if self.transpose else full

    def to_hf(self, full: np.ndarray) -> Dict[str, np.ndarray]:
        hf = full.T if self.transpose else full
        if len(self.hf_names) == 1:
            return {self.hf_names[0]: np.ascontiguousarray(hf)}
        sizes = [self.parts[i] for i in range(len(self.hf_names))]
        pieces = np.split(hf, np.cumsum(sizes)[:-1], axis=0)
        return {n: np.ascontiguousarray(p) for n, p in zip(self.hf_names, pieces)}

    # ---------------------------------------------------------------- tensor-parallel shards
    def local_part(self, part: int, tp: int) -> int:
        if part % tp:
            if not self.pad:
                raise ValueError(f"{self.hf_names[0]}: size {part} is not divisible by tensor_parallel_degree {tp}")
            return -(-part // tp)
        return part // tp

    def local_size(self, tp: int) -> int:
        return sum(self.local_part(p, tp) for p in self.parts)

    def shard(self, full: np.ndarray, rank: int, tp: int) -> np.ndarray:
        """This rank's shard of the full local-layout tensor (padded parts padded with zeros)."""
        if self.axis is None or tp == 1:
            return full
        pieces = []
        for part in np.split(full, np.cumsum(self.parts)[:-1], axis=self.axis):
            size = self.local_part(part.shape[self.axis], tp)
            missing = size * tp - part.shape[self.axis]
            if missing:
                widths = [(0, 0)] * part.ndim
                widths[self.axis] = (0, missing)
                part = np.pad(part, widths)
            pieces.append(np.take(part, range(rank * size, (rank + 1) * size), axis=self.axis))
        return np.ascontiguousarray(np.concatenate(pieces, axis=self.axis))

    def unshard(self, shards: Sequence[np.ndarray]) -> np.ndarray:
        """The full tensor from every rank's shard (rank order), padding cut off."""
        if self.axis is None or len(shards) == 1:
            return shards[0]
        tp = len(shards)
        sizes = [self.local_part(p, tp) for p in self.parts]
        split = [np.split(s, np.cumsum(sizes)[:-1], axis=self.axis) for s in shards]  # [rank][part]
        parts = []
        for k, logical in enumerate(self.parts):
            whole = np.concatenate([split[r][k] for r in range(tp)], axis=self.axis)
            parts.append(np.take(whole, range(logical), axis=self.axis))
        return np.concatenate(parts, axis=self.axis)


def _param(layer: nn.Layer, shape, spec: ParamSpec, group, is_bias: bool = False, init=None):
    param = layer.create_parameter(list(shape), is_bias=is_bias, default_initializer=init)
    param.spec = spec
    param.is_distributed = spec.axis is not None and group_size(group) > 1
    return param


class RMSNorm(nn.Layer):
    """x / rms(x) * weight; `offset` (Gemma): the weight is stored as an offset from 1, x / rms(x) * (1 + weight)."""

    def __init__(self, dim: int, eps: float, hf_name: str, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = _param(self, [dim], ParamSpec((hf_name,)), None,
                             init=nn.initializer.Constant(0.0 if offset else 1.0))

    @property
    def scale(self):
        """What the normalized x is multiplied by."""
        return 1.0 + self.weight if self.offset else self.weight

    def forward(self, x):
        return ops.rms_norm(x, self.scale, self.eps)


class Bf16Products(nn.Layer):
    """A layer whose matmuls follow the run's compute precision: `bf16` (set by CausalLM.set_bf16, from
    trainer/precision.py) makes `product` ops.bf16_linear (bfloat16-rounded operands, float32 sums, in the forward
    and both gradients), else it is paddle.matmul, bit for bit the float32 layer. The decoder's linear layers, the
    LoRA adapters, the MoE router and experts and the score head (a critic's value head) are these."""

    def __init__(self):
        super().__init__()
        self.bf16 = False
        # with bf16 on: the half precision the products take instead of bf16's own (an ops.HalfProducts: fp16, or
        # the rounded outputs of AMP O2; trainer/precision.py), else None
        self.half = None

    def product(self, x, weight):
        """x [..., K] @ weight [K, N] in this layer's precision."""
        if self.bf16:
            return ops.bf16_linear(x, weight) if self.half is None else self.half(x, weight)
        return paddle.matmul(x, weight)


class _Linear(Bf16Products):
    """What ColumnLinear and RowLinear share: a LoRA adapter, the rollout's packed copy of the weight and the
    compute precision (`bf16`: the products take bfloat16-rounded operands, ops.bf16_linear; trainer/precision.py)."""

    def __init__(self):
        super().__init__()
        self.lora = None    # a LoRA adapter (models/lora.py) when one is put on this layer
        self.packed = None  # the rollout's packed copy of effective_weight (CausalLM.packed_weights)
        # self.bf16: bf16 products (the packed copy wins while it exists)

    @property
    def reads_input_rounded(self) -> bool:
        """Whether the forward reads x only through its bfloat16 rounding: bf16 products, no packed copy, and no
        LoRA dropout in training (it scales x before the adapter's product rounds it). A block whose input only
        such layers read can be recomputed from that rounding (models/decoder.py, recompute_from_bf16)."""
        if not self.bf16 or self.half is not None or self.packed is not None:
            return False
        lora = self.lora
        return (lora is None or lora.merged is not None or not lora.enabled
                or (lora.bf16 and not (lora.p > 0 and lora.training)))

    @property
    def effective_weight(self):
        """What x is multiplied by: the weight, or the LoRA-merged one while merged."""
        return self.weight if self.lora is None else self.lora.weight(self.weight)

    def project(self, x, weight):
        """x @ weight: from the packed copy while the rollout holds one, else a matmul (a weight stored in bfloat16,
        store_weight_bf16: read as it is by bf16_linear's kernel, else widened for it: exact)."""
        if self.packed is not None:
            return ops.packed_linear(x, self.packed, weight.shape[1])
        return self.product(x, weight if weight.dtype == paddle.float32 or self.bf16 else weight.astype("float32"))

    def store_weight_bf16(self) -> None:
        """Keep the weight as its bfloat16 rounding (nearest even), half the bytes, for a model that only runs
        bf16 forwards (a frozen reference): its products round the weight to bfloat16 anyway, so they are the same
        bits. The parameter object stays (its dtype becomes bfloat16); an error if the layer does not compute in
        bf16 or takes gradients."""
        if not self.bf16 or not self.weight.stop_gradient or self.lora is not None:
            raise ValueError(f"{self.module_names[0]}: only a frozen layer computing in bf16 (no LoRA) can store its "
                             "weight in bfloat16")
        if self.weight.dtype == paddle.bfloat16:
            return
        rounded = self.weight.astype("bfloat16")
        self.weight.value().get_tensor()._share_data_with(rounded.value().get_tensor())  # as nn.Layer.to does


class ColumnLinear(_Linear):
    """y = x @ W (+ b) with the output features split over the group; `sources` are the HF sub-modules fused
    into it under `prefix` (q_proj, k_proj, v_proj), `parts` their output sizes."""

    def __init__(self, in_features: int, parts: Sequence[int], bias: bool, group, prefix: str,
                 sources: Sequence[str], pad: bool = False):
        super().__init__()
        self.group = group
        names = tuple(f"{prefix}.{s}" if prefix else s for s in sources)
        self.module_names = names
        tp = group_size(group)
        weight = ParamSpec(tuple(f"{n}.weight" for n in names), True, 1, tuple(parts), pad)
        self.weight = _param(self, [in_features, weight.local_size(tp)], weight, group)
        self.bias = None
        if bias:
            spec = ParamSpec(tuple(f"{n}.bias" for n in names), False, 0, tuple(parts), pad)
            self.bias = _param(self, [spec.local_size(tp)], spec, group, is_bias=True)

    def forward(self, x, tokens=None):
        """`tokens` (sequence parallelism): x holds this rank's tokens; y all of them."""
        weight = self.effective_weight
        if tokens is not None:
            if tokens.keep_own and self.packed is None and not self.bf16 and weight.dtype == paddle.float32:
                y = tokens.gather_matmul(x, weight)  # keeps this rank's tokens, not the gathered ones
            else:
                y = self.project(tokens.gather(x), weight)
            y = y + self.bias if self.bias is not None else y
        elif self.group is None and self.packed is None and not self.bf16:
            y = ops.affine(x, weight, self.bias)  # Paddle's linear op (use_fused_linear: false: two)
        else:
            y = self.project(copy_to_group(x, self.group), weight)
            y = y if self.bias is None else y + (self.bias if self.packed is None else self._bias_like(y))
        return y if self.lora is None else self.lora.add(x, y, tokens)

    def _bias_like(self, y):
        """The bias expanded to y's shape, kept while the packed copy and the shape stay (a decode step's rows):
        Paddle's CPU add broadcasting [N] over [rows, 1, N] takes ~3x the time of adding a tensor of y's shape,
        the same sums. The rollout's (packed copies are inference only); dropped with the packed copy."""
        held = self.__dict__.get("packed_bias")
        if held is None or held[0] is not self.packed or held[1].shape != y.shape:
            held = (self.packed, paddle.expand(self.bias, y.shape))
            self.__dict__["packed_bias"] = held   # a plain attribute, as `packed` (not a buffer of the layer)
        return held[1]


class RowLinear(_Linear):
    """y = x @ W (+ b) with the input features split over the group; partial outputs summed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group, hf_name: str):
        super().__init__()
        self.group = group
        self.module_names = (hf_name,)
        spec = ParamSpec((f"{hf_name}.weight",), True, 0, (in_features,))
        self.weight = _param(self, [spec.local_size(group_size(group)), out_features], spec, group)
        self.bias = _param(self, [out_features], ParamSpec((f"{hf_name}.bias",)), None, True) if bias else None

    def forward(self, x, tokens=None):
        """`tokens` (sequence parallelism): x holds every token, y this rank's (summed by a reduce-scatter; the bias
        is then added to this rank's tokens, so its gradient is summed over the group: decoder.py
        sequence_parallel_parameters)."""
        weight = self.effective_weight
        if tokens is not None:
            y = tokens.reduce_scatter(self.project(x, weight))
            y = y + self.bias if self.bias is not None else y
        elif self.group is None and self.packed is None and not self.bf16:
            y = ops.affine(x, weight, self.bias)  # Paddle's linear op (use_fused_linear: false: two)
        else:
            y = reduce_from_group(self.project(x, weight), self.group)
            y = y + self.bias if self.bias is not None else y
        return y if self.lora is None else self.lora.add(x, y, tokens)


class ScoreHead(Bf16Products):
    """A sequence classifier's head (`score.weight` [num_labels, hidden] in the checkpoint, no bias), replicated;
    with `bf16` its products take bfloat16 operands like the LM head's (set_bf16's `head`)."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.weight = _param(self, [hidden_size, num_labels], ParamSpec(("score.weight",), True), None)

    def forward(self, x):
        return self.product(x, self.weight)


class VocabEmbedding(nn.Layer):
    def __init__(self, vocab_size: int, hidden_size: int, group, hf_name: str):
        super().__init__()
        self.group = group
        spec = ParamSpec((hf_name,), False, 0, (vocab_size,), pad=True)
        self.per_rank = spec.local_size(group_size(group))
        self.vocab_start = group_rank(group) * self.per_rank
        self.weight = _param(self, [self.per_rank, hidden_size], spec, group,
                             init=nn.initializer.XavierNormal())

    def forward(self, ids, tokens=None):
        """`tokens` (sequence parallelism): ids [B, T] of every token, the embeddings of this rank's tokens."""
        if self.group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = paddle.logical_and(local >= 0, local < self.per_rank)
        emb = F.embedding(paddle.where(inside, local, paddle.zeros_like(local)), self.weight)
        emb = emb * inside.astype(emb.dtype).unsqueeze(-1)
        return reduce_from_group(emb, self.group) if tokens is None else tokens.reduce_scatter(emb)


def vocab_parallel_logprobs(local_logits, targets, group, vocab_start: int, with_entropy: bool = False):
    """log softmax(logits)[target] (and entropy) from this rank's vocabulary slice of the logits (padding
    already cut off: the slices may differ in width).

    local_logits [..., V_r] float32, targets [...] int64 (global ids). Differentiable: the sums go through
    reduce_from_group (identity backward), the max shift is a constant. The full [tokens, vocab] logits never
    exist on one rank.
    """
    width = local_logits.shape[-1]
    shift = all_reduce_max(local_logits.max(axis=-1, keepdim=True), group)
    shifted = local_logits - shift
    exp = shifted.exp()
    sum_exp = reduce_from_group(exp.sum(axis=-1), group)
    log_z = sum_exp.log()
    local = targets - vocab_start
    inside = paddle.logical_and(local >= 0, local < width)
    picked = paddle.take_along_axis(shifted, paddle.where(inside, local, paddle.zeros_like(local)).unsqueeze(-1),
                                    axis=-1).squeeze(-1)
    target = reduce_from_group(picked * inside.astype(picked.dtype), group)
    logp = target - log_z
    if not with_entropy:
        return logp, None
    # H = log Z - E_p[shifted]
    expected = reduce_from_group((exp * shifted).sum(axis=-1), group) / sum_exp
    return logp, log_z - expected


def vocab_parallel_argmax(local_logits, group, vocab_start: int):
    """The global argmax over the vocabulary [...] int64 from this rank's slice of the logits: the ranks holding
    the largest value offer their first index of it, the smallest offer wins (paddle.argmax's tie rule). Ids
    stay below 2^24, exact in float32."""
    value = local_logits.max(axis=-1)
    top = all_reduce_max(value, group)
    index = (paddle.argmax(local_logits, axis=-1) + vocab_start).astype("float32")
    offer = paddle.where(value == top, index, paddle.full_like(index, float(2 ** 24)))
    return (-all_reduce_max(-offer, group)).astype("int64")


def specs_of(model, frozen: bool = True) -> List[Tuple[str, object]]:
    """(name, parameter) pairs of a model, every one with its ParamSpec (an error names one without);
    `frozen=False` keeps the trained ones only (a LoRA model's adapters)."""
    out = []
    for name, param in model.named_parameters():
        if getattr(param, "spec", None) is None:
            raise TypeError(f"parameter {name} has no ParamSpec: build it with models/layers.py")
        if frozen or not param.stop_gradient:
            out.append((name, param))
    return out
