"""Tensor-parallel layers (Megatron-style) on differentiable collectives, and their checkpoint shards.

- ColumnParallelLinear: weight [in, out/tp]. A fused projection lists its logical parts (q, k, v or
  gate, up); rank r holds [part_0 shard r, part_1 shard r, ...], so the local output splits like the
  full one. The input enters through copy_to_group (its gradient is all-reduced).
- RowParallelLinear: weight [in/tp, out] on the rank's slice of the input features; partial outputs are
  all-reduced (bias added after the sum).
- VocabParallelEmbedding: rows [r*V/tp, (r+1)*V/tp) of the table; tokens outside give zeros, the
  group sums the lookups.
- vocab_parallel_logprobs: log softmax at the target and the entropy from vocabulary-sharded logits
  with max and sum all-reduces: the full [tokens, vocab] logits never exist on one rank.

`shard_param` / `unshard_param` cut a full (local-layout) tensor into a rank's shard and glue the
shards back, driven by the `tp_spec` each parallel parameter carries.
"""
from typing import List, Optional, Sequence

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .collectives import all_reduce_max, copy_to_group, gather_from_group, group_rank, group_size, reduce_from_group


class TPSpec:
    """How a parameter is split: axis (0 or 1 of the local-layout tensor) and the logical parts along it."""

    def __init__(self, axis: int, parts: Sequence[int]):
        self.axis = axis
        self.parts = list(parts)

    def __repr__(self):
        return f"TPSpec(axis={self.axis}, parts={self.parts})"


def _tag(param, spec: TPSpec):
    param.is_distributed = True
    param.tp_spec = spec
    return param


def _check_divisible(parts, tp, what):
    for p in parts:
        if p % tp:
            raise ValueError(f"{what}: size {p} is not divisible by tensor_parallel_degree {tp}")


class ColumnParallelLinear(nn.Layer):
    def __init__(self, in_features: int, parts: Sequence[int], bias: bool, group, gather_output: bool = False):
        super().__init__()
        self.group = group
        tp = group_size(group)
        _check_divisible(parts, tp, "column-parallel output")
        local = sum(p // tp for p in parts)
        self.gather_output = gather_output
        self.weight = _tag(self.create_parameter([in_features, local]), TPSpec(1, parts))
        self.bias = _tag(self.create_parameter([local], is_bias=True), TPSpec(0, parts)) if bias else None

    def forward(self, x):
        y = paddle.matmul(copy_to_group(x, self.group), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return gather_from_group(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Layer):
    def __init__(self, in_features: int, out_features: int, bias: bool, group):
        super().__init__()
        self.group = group
        tp = group_size(group)
        _check_divisible([in_features], tp, "row-parallel input")
        self.weight = _tag(self.create_parameter([in_features // tp, out_features]), TPSpec(0, [in_features]))
        self.bias = self.create_parameter([out_features], is_bias=True) if bias else None

    def forward(self, x):
        y = reduce_from_group(paddle.matmul(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Layer):
    def __init__(self, vocab_size: int, hidden_size: int, group):
        super().__init__()
        self.group = group
        tp = group_size(group)
        _check_divisible([vocab_size], tp, "vocab_size")
        self.per_rank = vocab_size // tp
        self.vocab_start = group_rank(group) * self.per_rank
        self.weight = _tag(self.create_parameter([self.per_rank, hidden_size]), TPSpec(0, [vocab_size]))

    def forward(self, ids):
        local = ids - self.vocab_start
        inside = paddle.logical_and(local >= 0, local < self.per_rank)
        emb = F.embedding(paddle.where(inside, local, paddle.zeros_like(local)), self.weight)
        emb = emb * inside.astype(emb.dtype).unsqueeze(-1)
        return reduce_from_group(emb, self.group)


def column_linear(in_features: int, parts: Sequence[int], bias: bool, group):
    """nn.Linear without a group (the single-process layer, unchanged), ColumnParallelLinear with one."""
    if group is None:
        return nn.Linear(in_features, sum(parts), bias_attr=None if bias else False)
    return ColumnParallelLinear(in_features, parts, bias, group)


def row_linear(in_features: int, out_features: int, bias: bool, group):
    if group is None:
        return nn.Linear(in_features, out_features, bias_attr=None if bias else False)
    return RowParallelLinear(in_features, out_features, bias, group)


def embedding(vocab_size: int, hidden_size: int, group):
    if group is None:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, group)


def local_heads(config, group):
    """(query heads, kv heads) on this rank."""
    tp = group_size(group)
    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        raise ValueError(f"tensor_parallel_degree {tp} must divide num_attention_heads ({config.num_attention_heads}) "
                         f"and num_key_value_heads ({config.num_key_value_heads})")
    if config.intermediate_size % tp or config.vocab_size % tp:
        raise ValueError(f"tensor_parallel_degree {tp} must divide intermediate_size ({config.intermediate_size}) "
                         f"and vocab_size ({config.vocab_size})")
    return config.num_attention_heads // tp, config.num_key_value_heads // tp


# ---------------------------------------------------------------------- log-probs from sharded logits

def vocab_parallel_logprobs(local_logits, targets, group, vocab_start: int, with_entropy: bool = False):
    """log softmax(logits)[target] (and entropy) from this rank's vocabulary slice of the logits.

    local_logits [..., V/tp] float32, targets [...] int64 (global ids). Differentiable: the sums go
    through reduce_from_group (identity backward), the max shift is a constant.
    """
    per_rank = local_logits.shape[-1]
    shift = all_reduce_max(local_logits.max(axis=-1, keepdim=True), group)
    shifted = local_logits - shift
    exp = shifted.exp()
    sum_exp = reduce_from_group(exp.sum(axis=-1), group)
    log_z = sum_exp.log()
    local = targets - vocab_start
    inside = paddle.logical_and(local >= 0, local < per_rank)
    picked = paddle.take_along_axis(shifted, paddle.where(inside, local, paddle.zeros_like(local)).unsqueeze(-1),
                                    axis=-1).squeeze(-1)
    target = reduce_from_group(picked * inside.astype(picked.dtype), group)
    logp = target - log_z
    if not with_entropy:
        return logp, None
    # H = log Z - E_p[shifted]
    expected = reduce_from_group((exp * shifted).sum(axis=-1), group) / sum_exp
    return logp, log_z - expected


# ---------------------------------------------------------------------- checkpoint shards

def _split_parts(array: np.ndarray, spec: TPSpec, tp: int) -> List[List[np.ndarray]]:
    """[part][rank] pieces of a full tensor."""
    bounds = np.cumsum(spec.parts)[:-1]
    parts = np.split(array, bounds, axis=spec.axis)
    return [np.split(p, tp, axis=spec.axis) for p in parts]


def shard_array(array: np.ndarray, spec: Optional[TPSpec], rank: int, tp: int) -> np.ndarray:
    """This rank's shard of a full local-layout tensor."""
    if spec is None or tp == 1:
        return array
    pieces = _split_parts(array, spec, tp)
    return np.ascontiguousarray(np.concatenate([p[rank] for p in pieces], axis=spec.axis))


def unshard_arrays(shards: Sequence[np.ndarray], spec: Optional[TPSpec]) -> np.ndarray:
    """The full tensor from every rank's shard (rank order)."""
    if spec is None or len(shards) == 1:
        return shards[0]
    tp = len(shards)
    local_parts = [p // tp for p in spec.parts]
    bounds = np.cumsum(local_parts)[:-1]
    split = [np.split(s, bounds, axis=spec.axis) for s in shards]  # [rank][part]
    return np.concatenate([np.concatenate([split[r][k] for r in range(tp)], axis=spec.axis)
                           for k in range(len(spec.parts))], axis=spec.axis)


def param_specs(model) -> dict:
    """name -> TPSpec (None for replicated parameters)."""
    return {name: getattr(p, "tp_spec", None) for name, p in model.named_parameters()}


def full_param_specs(config) -> dict:
    """name -> TPSpec of every parameter of the full model, without building one (for resharding)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    specs = {"embed_tokens.weight": TPSpec(0, [config.vocab_size]), "norm.weight": None}
    if not config.tie_word_embeddings:
        specs["lm_head.weight"] = TPSpec(1, [config.vocab_size])
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        specs[p + "self_attn.qkv_proj.weight"] = TPSpec(1, [q, kv, kv])
        if config.attention_bias:
            specs[p + "self_attn.qkv_proj.bias"] = TPSpec(0, [q, kv, kv])
        specs[p + "self_attn.o_proj.weight"] = TPSpec(0, [q])
        if config.uses_qk_norm:
            specs[p + "self_attn.q_norm.weight"] = None
            specs[p + "self_attn.k_norm.weight"] = None
        specs[p + "mlp.gate_up_proj.weight"] = TPSpec(1, [config.intermediate_size] * 2)
        specs[p + "mlp.down_proj.weight"] = TPSpec(0, [config.intermediate_size])
        specs[p + "input_layernorm.weight"] = None
        specs[p + "post_attention_layernorm.weight"] = None
    return specs


def shard_state(config, local: dict, rank: int, tp: int) -> dict:
    """A full local-layout state dict -> this rank's shards."""
    specs = full_param_specs(config)
    return {k: shard_array(v, specs.get(k), rank, tp) for k, v in local.items()}


def gather_state(model, group) -> dict:
    """Full local-layout numpy state of a tensor-parallel model, on every rank of the group."""
    import paddle.distributed as dist
    tp = group_size(group)
    out = {}
    for name, param in model.named_parameters():
        spec = getattr(param, "tp_spec", None)
        if spec is None or tp == 1:
            out[name] = param.numpy()
            continue
        parts: list = []
        dist.all_gather(parts, param.detach(), group=group)
        out[name] = unshard_arrays([p.numpy() for p in parts], spec)
    return out
