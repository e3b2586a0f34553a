"""The decoder of every family in family.py (Qwen2/2.5 q/k/v bias, Qwen3 q/k RMSNorm, Llama, Mistral; Qwen2-MoE and
Qwen3-MoE with the sparse blocks of moe.py in place of the MLP).

Activations are [batch, tokens, hidden]. q/k/v and gate/up projections are stored fused (one matmul each);
each parameter carries its Hugging Face names and tensor-parallel split (layers.py).

One forward serves training, prefill and decode: a `Pass` describes the tokens being run (positions, the
attention bias, the KV caches) and every layer reads it. A decode step (one new token per row against a
preallocated cache) takes the fused path in `Attention`: qkv projection -> `rotary_qkv_cache` (split, q/k
norm, rotary, cache write in place) -> `decode_attention` (left padding skipped by a per-row start slot). The
rollout runs inside `packed_weights()`, where the linear layers and the tied head multiply by packed copies.
A pipeline stage is the same model restricted to a range of layers (`stage=(index, count)`).
"""
import contextlib
import copy
import logging
import math
from typing import List, Optional

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from .. import ops
from ..parallel.collectives import ContextSplit, TokenSplit, copy_to_group, gather_from_group, group_size
from .config import ModelConfig
from .layers import Bf16Products, ColumnLinear, RMSNorm, RowLinear, ScoreHead, VocabEmbedding, vocab_parallel_argmax, \
    vocab_parallel_logprobs
from .moe import Expert, MoESettings, RouterStats, SparseMoE

logger = logging.getLogger("paddle_rl")

NEG_INF = -1e9


class RotaryEmbedding:
    """cos/sin tables of rotate-half RoPE for arbitrary position ids. `scaling` (ModelConfig.rope) rescales the
    inverse frequencies: linear (all divided by the factor) or llama3 (long wavelengths divided by the factor,
    short ones kept, a smooth blend between); every path (the tables and the fused decode step) reads
    `inv_freq`, so scaling them here scales all."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict] = None, local_theta: Optional[float] = None):
        exponents = paddle.arange(0, head_dim, 2, dtype="int64").astype("float32") / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)
        if scaling is not None:
            self.inv_freq = scaled_inv_freq(self.inv_freq, scaling)
        # the sliding-window layers' own rotary embedding (Gemma 3: rope_local_base_freq, never scaled)
        self.local = None if local_theta is None else RotaryEmbedding(head_dim, local_theta)

    def __call__(self, position_ids):
        """cos, sin [B, T, 1, head_dim]."""
        return ops.rotary_tables(position_ids, self.inv_freq)


def scaled_inv_freq(inv_freq, scaling: dict):
    """Inverse frequencies under a rope scaling (transformers' linear and llama3 rope types)."""
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = paddle.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = paddle.logical_and(wavelen >= context / high, wavelen <= context / low)
    return paddle.where(medium, blended, scaled)


def _hold(layer, name: str, copy) -> None:
    """layer.name = copy as a plain attribute (a packed Tensor or ops.LowpPacked): Layer.__setattr__ would make a
    Tensor a buffer of the layer, and then refuse anything else but a Tensor or None in its place."""
    layer.__dict__[name] = copy


def _recompute(fn, *args, reentrant: bool = False):
    """fn(*args) whose activations are recomputed in the backward instead of kept: Paddle's non-reentrant recompute
    (saved-tensor hooks), or with `reentrant` (recompute_use_reentrant, Pass.reentrant) its reentrant one (a PyLayer
    that runs fn without autograd and again with it in the backward); the same gradients."""
    from paddle.distributed.fleet.utils import recompute
    return recompute(fn, *args, use_reentrant=reentrant)


class _RecomputeFromBf16(PyLayer):
    # fn runs without autograd in the forward; the backward widens the kept rounding (exact), runs fn again with
    # autograd and backpropagates through it: the parameters inside fn take their gradients there, h's is returned.
    @staticmethod
    def forward(ctx, h, fn):
        ctx.fn = fn
        ctx.save_for_backward(ops.to_bf16(h))
        return fn(h)

    @staticmethod
    def backward(ctx, dy):
        (hb,) = ctx.saved_tensor()
        h = hb.astype("float32")
        h.stop_gradient = False
        with paddle.set_grad_enabled(True):
            y = ctx.fn(h)
        paddle.autograd.backward([y], [dy])
        return h.grad


def recompute_from_bf16(fn, h):
    """fn(h), its activations recomputed in the backward from h's bfloat16 rounding, the one tensor kept (half of
    h's bytes). For a block that reads h only through bf16 products (their operands are that rounding, so the
    recomputation makes the same bits and the same gradients as keeping everything); h must take a gradient."""
    return _RecomputeFromBf16.apply(h, fn)


class _MlpRecompute(PyLayer):
    # A dense MLP block (its norm, gate / up, the gated activation, down) keeping only its input. The forward runs
    # the block without autograd; the backward runs it again with autograd up to the down projection's input and
    # takes the down projection's gradients from that input (ops.product_gradients) without its forward, whose
    # output the backward does not need: Paddle's recompute runs the whole block again, a third more products.
    # The same gradients, bit for bit (tests/test_ops.py).
    @staticmethod
    def fits(layer) -> bool:
        """The layer's block is the pre-norm dense MLP and its down projection a plain product (no LoRA, bias,
        tensor parallelism, packed copy or half products)."""
        mlp = layer.mlp
        if not isinstance(mlp, MLP) or layer.sandwich:
            return False
        down, gate_up = mlp.down_proj, mlp.gate_up_proj
        return (down.lora is None and gate_up.lora is None and down.bias is None and down.group is None
                and down.packed is None and down.half is None and down.weight.dtype == paddle.float32)

    @staticmethod
    def applies(layer, x, p) -> bool:
        """The block fits, without sequence parallelism, and its input takes a gradient (else the parameters inside
        would not get theirs through a PyLayer); otherwise Paddle's recompute runs it."""
        return (p.tokens is None and not x.stop_gradient and paddle.is_grad_enabled()
                and _MlpRecompute.fits(layer))

    @staticmethod
    def forward(ctx, x, layer, p):
        ctx.layer, ctx.p = layer, p
        ctx.save_for_backward(x)
        return layer._mlp_block(x, p)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensor()
        layer = ctx.layer
        down = layer.mlp.down_proj
        x = x.detach()
        x.stop_gradient = False
        with paddle.set_grad_enabled(True):
            inner = layer.mlp.inner(layer.post_attention_layernorm(x))
            y = ops.product_gradients(inner, down.weight, bf16=down.bf16)
        paddle.autograd.backward([y], [dy])
        return x.grad


def mlp_recompute_reruns_down(model) -> bool:
    """Whether recompute_granularity core_attn_mlp reruns some dense MLP block whole, its down projection's forward
    included (a block _MlpRecompute does not fit; sequence parallelism, decided per pass, is not seen here)."""
    return any(isinstance(m, DecoderLayer) and isinstance(m.mlp, MLP) and not _MlpRecompute.fits(m)
               for m in model.sublayers())


class LayerCache:
    """Keys and values of one layer: buffers k, v [B, kv_heads, capacity, head_dim] allocated once and written
    in place; slots [0, length) hold the tokens seen so far. Without a capacity the buffers grow by doubling.
    `dtype` (None: the computed keys' dtype) is what the buffers store: a 16-bit cache holds keys and values
    rounded to it, and attention reads them back in the compute dtype (the rollout's kv_cache_dtype)."""

    def __init__(self, capacity: int = 0, dtype=None):
        self.capacity = capacity
        self.dtype = dtype
        self.k = None
        self.v = None
        self.length = 0

    def update(self, k, v):
        """Append k, v [B, kv_heads, L, head_dim]; returns the filled keys and values in k's dtype."""
        dtype = k.dtype
        start, end = self.length, self.length + k.shape[2]
        self.reserve(k.shape, k.dtype, end)
        if k.dtype != self.k.dtype:
            k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        keys, values = self.keys, self.values
        if keys.dtype != dtype:
            keys, values = keys.astype(dtype), values.astype(dtype)
        return keys, values

    def reserve(self, shape, dtype, needed: int):
        """Buffers [B, kv_heads, >= needed, head_dim] (B, kv_heads, head_dim from `shape`; the cache's own dtype,
        else `dtype`), the filled slots kept."""
        if self.k is not None and needed <= self.k.shape[2]:
            return
        size = max(needed, self.capacity, 2 * (0 if self.k is None else self.k.shape[2]))
        shape = [shape[0], shape[1], size, shape[3]]
        dtype = self.dtype or (self.k.dtype if self.k is not None else dtype)
        # uninitialized: the slots from `length` on are written before anything reads them (update writes its
        # tokens' slots, then returns the slots below its end; a decode step writes its slot, then attends up to it)
        k, v = paddle.empty(shape, dtype), paddle.empty(shape, dtype)
        if self.length:
            k[:, :, :self.length] = self.keys
            v[:, :, :self.length] = self.values
        self.k, self.v = k, v

    @property
    def keys(self):
        return self.k if self.length == self.k.shape[2] else self.k[:, :, :self.length]

    @property
    def values(self):
        return self.v if self.length == self.v.shape[2] else self.v[:, :, :self.length]


class RecordingCache:
    """Keeps the keys and values of one layer's pass (autograd intact) so a later pass can attend to them."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k, v):
        self.k, self.v = k, v
        return k, v


class PrefixCache:
    """Prepends fixed keys/values (a prompt's, gathered per row) to the keys/values of the tokens being run."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def update(self, k, v):
        return paddle.concat([self.k, k], axis=2), paddle.concat([self.v, v], axis=2)


def new_cache(config: ModelConfig, capacity: int = 0) -> List[LayerCache]:
    """One LayerCache per layer; `capacity` (prompt + response slots) preallocates the buffers."""
    return [LayerCache(capacity) for _ in range(config.num_hidden_layers)]


class Pass:
    """What every layer reads about the tokens of one forward: rotary tables (or, for a decode step, the
    positions and inverse frequencies the fused kernel takes), the additive attention bias and per-layer
    caches. `decode_start` [B] marks a decode step: one token per row, attending to cache slots from
    decode_start[b] on. MoE blocks add their router statistics to `router` (none in a decode step), each token
    weighted by `token_weight` [B, T] (0 on padding; None: every token counts once). `packing` (packing.Packing)
    marks a packed row of several sequences: attention runs on its blocks instead of a bias over the row.
    `tokens` (set by CausalLM.run under sequence parallelism: collectives.TokenSplit): the residual stream and the
    norms hold this rank's share of the tokens; the tensor-parallel blocks gather them and scatter their output.
    `context` (set by CausalLM.run under context parallelism: collectives.ContextSplit): every layer holds this rank's
    slice of the tokens and attention trades it for a slice of the heads around its core; `split_context` (set by
    the callers that read the output on a rank's own tokens) asks for it.
    `recompute` (set by CausalLM.run in training): what the backward recomputes, None or "full" (each layer),
    "full_attn" (each self-attention block), "core_attn" (softmax(QK^T)V, whose probabilities grow with the
    sequence) or "core_attn_mlp" (that and each dense MLP block with its norm)."""

    def __init__(self, rotary, position_ids, attention_bias=None, caches=None, decode_start=None, token_weight=None,
                 router=None, packing=None, decode_shared=None):
        self.position_ids = position_ids
        self.packing = packing
        self.recompute = None
        self.reentrant = False   # recompute_use_reentrant (set by CausalLM.run with `recompute`)
        self.tokens = None
        self.context = None
        self.split_context = False
        self.attention_bias = attention_bias
        self.caches = caches
        self.decode_start = decode_start
        self.decode_shared = decode_shared   # a decode step's rows that share their prompt's slots (ops.decode_layer)
        self._token_weight, self._flat_weight = token_weight, None   # flattened when an MoE block reads it
        self.router = None if decode_start is not None else router if router is not None else RouterStats()
        self.inv_freq = rotary.inv_freq
        self.cos, self.sin = (None, None) if decode_start is not None else rotary(position_ids)
        local = rotary.local  # the sliding-window layers' tables (None: every layer reads the ones above)
        self.local_inv_freq = None if local is None else local.inv_freq
        self.local_cos, self.local_sin = (None, None) if local is None or decode_start is not None \
            else local(position_ids)
        self._window_bias = {}

    def window_bias(self, window: int):
        """The attention bias of a sliding-window layer: `attention_bias` with the keys `window` or more slots
        before the query masked too (transformers' kv_idx > q_idx - window). Within a row the real tokens sit in
        consecutive slots (left padding, then the prompt and response), so slots count positions."""
        if window not in self._window_bias:
            bias = self.attention_bias
            queries, keys = bias.shape[-2], bias.shape[-1]
            q_slot = paddle.arange(keys - queries, keys, dtype="int64").unsqueeze(1)
            far = (q_slot - paddle.arange(keys, dtype="int64").unsqueeze(0)) >= window
            self._window_bias[window] = bias + far.astype(bias.dtype) * NEG_INF
        return self._window_bias[window]

    @property
    def decode(self) -> bool:
        return self.decode_start is not None

    @property
    def token_weight(self):
        """`token_weight` as [B * T] float32 (None: every token once), made on the first read (MoE blocks')."""
        if self._flat_weight is None and self._token_weight is not None:
            self._flat_weight = self._token_weight.astype("float32").reshape([-1])
        return self._flat_weight

    def kept(self) -> "Pass":
        """This pass with nothing recomputed: for a block that is itself recomputed as a whole."""
        inner = copy.copy(self)
        inner.recompute = None
        return inner

    def cache(self, i: int):
        return None if self.caches is None else self.caches[i]


class Attention(nn.Layer):
    def __init__(self, config: ModelConfig, tp_group, prefix: str, index: int = 0):
        super().__init__()
        tp = group_size(tp_group)
        if config.num_attention_heads % tp or config.num_key_value_heads % tp:
            raise ValueError(f"tensor_parallel_degree {tp} must divide num_attention_heads "
                             f"({config.num_attention_heads}) and num_key_value_heads ({config.num_key_value_heads})")
        self.num_heads, self.num_kv_heads = config.num_attention_heads // tp, config.num_key_value_heads // tp
        self.head_dim = config.head_dim
        self.scale = config.family.query_scale(config)
        # a sliding-window layer attends to its last `window` positions and turns by the local rotary base
        self.window = config.family.sliding_windows(config)[index]
        self.split_sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                            self.num_kv_heads * self.head_dim]
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnLinear(config.hidden_size, [q_size, kv_size, kv_size], config.family.qkv_bias(config),
                                     tp_group, prefix, ("q_proj", "k_proj", "v_proj"))
        self.o_proj = RowLinear(q_size, config.hidden_size, False, tp_group, f"{prefix}.o_proj")
        self.qk_norm = config.uses_qk_norm
        if self.qk_norm:
            offset = config.family.norm_offset
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, f"{prefix}.q_norm.weight", offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, f"{prefix}.k_norm.weight", offset)

    def forward(self, x, p: Pass, cache=None):
        if p.decode:
            return self.o_proj(self._decode(x, p, cache))
        proj, (cos, sin) = self.qkv_proj, self._tables(p)
        if (p.tokens is None and p.context is None and not self.qk_norm and proj.group is None and proj.lora is None
                and not proj.bf16 and ops.qkv_rotary_runs(cos, x, proj.weight, proj.bias)):
            # the product (from the rollout's packed copy in a prefill), then bias, split, rotary and the head-major
            # layout in one kernel (ops.qkv_rotary: the same bits as the linear layer and the ops below)
            qkv = proj.project(x, proj.weight)
            if p.packing is not None:
                # a packed row [1, N] as N rows of one token: the kernel's head-major [N, H, 1, d] is the packed
                # attention's token-major [N, H, d], so no transpose, and the bias's add and gradient are its own
                n, d = qkv.shape[1], self.head_dim
                q, k, v = ops.qkv_rotary(qkv.reshape([n, 1, qkv.shape[2]]), proj.bias, cos.reshape([n, 1, 1, d]),
                                         sin.reshape([n, 1, 1, d]), self.num_heads, self.num_kv_heads)
                return self._packed_core(q.reshape([1, n, self.num_heads, d]), k.reshape([1, n, self.num_kv_heads, d]),
                                         v.reshape([1, n, self.num_kv_heads, d]), p, self.o_proj)
            q, k, v = ops.qkv_rotary(qkv, proj.bias, cos, sin, self.num_heads, self.num_kv_heads)
            return self._heads_core(q, k, v, p, cache, self.o_proj)
        qkv = proj(x, p.tokens)  # under sequence parallelism x holds this rank's tokens, qkv all of them
        batch, length = qkv.shape[0], qkv.shape[1]
        q, k, v = paddle.split(qkv, self.split_sizes, axis=-1)
        q = q.reshape([batch, length, self.num_heads, self.head_dim])
        k = k.reshape([batch, length, self.num_kv_heads, self.head_dim])
        v = v.reshape([batch, length, self.num_kv_heads, self.head_dim])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if p.context is not None:
            return self.o_proj(self._context_core(q, k, v, p), p.tokens)
        return self._attend(q, k, v, p, cache)

    def _context_core(self, q, k, v, p: Pass):
        """Ulysses: q, k, v of this rank's tokens and all heads -> all tokens and this rank's heads (all-to-all), the
        attention core on whole sequences, and back (all-to-all): [B, local, heads * d]. Fewer key/value heads than
        the degree are repeated first, so that each rank's query heads find theirs (each kv head's copies take the
        sum of their gradients)."""
        split, size = p.context, p.context.size
        if self.num_kv_heads < size:
            repeat = size // self.num_kv_heads
            k, v = paddle.repeat_interleave(k, repeat, axis=2), paddle.repeat_interleave(v, repeat, axis=2)
        # one all-to-all for q, k and v: each rank's share of every one side by side [q_r | k_r | v_r]
        batch, length, d = q.shape[0], q.shape[1], self.head_dim
        heads, kv_heads = q.shape[2] // size, k.shape[2] // size
        qkv = paddle.concat([t.reshape([batch, length, size, -1, d]) for t in (q, k, v)], axis=3)
        qkv = split.to_heads(qkv.reshape([batch, length, size * (heads + 2 * kv_heads), d]))
        q, k, v = paddle.split(qkv, [heads, kv_heads, kv_heads], axis=2)
        out = self._attend(q, k, v, p, None, project=False)
        out = split.to_tokens(out.reshape([out.shape[0], out.shape[1], -1, self.head_dim]))
        return out.reshape([out.shape[0], out.shape[1], self.num_heads * self.head_dim])

    def _attend(self, q, k, v, p: Pass, cache, project: bool = True):
        """Rotary, then the attention core of q [B, L, H, d], k, v [B, L, KV, d]; its output through o_proj
        (`project`), else [B, L, H * d] as it is."""
        finish = (lambda out: self.o_proj(out, p.tokens)) if project else (lambda out: out)
        cos, sin = self._tables(p)
        q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        if p.packing is None:
            return self._heads_core(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3]),
                                    p, cache, finish)
        return self._packed_core(q, k, v, p, finish)

    def _packed_core(self, q, k, v, p: Pass, finish):
        """The attention core of a packed row (several sequences in one row: the packing's kernel or blocks) of
        rotated q [1, N, H, d], k, v [1, N, KV, d], through `finish`."""
        if self.window is not None:
            raise ValueError("use_remove_padding: packed micro-batches do not implement sliding-window attention "
                             f"(this model's layers have sliding_window {self.window}); set it to false")
        # core_attn recomputes the probabilities in the backward; the packed kernel's backward does that itself (it
        # keeps only the output and each row's softmax statistics), so the core is not run twice
        args = (q, k, v, self.scale)
        if p.recompute in ("core_attn", "core_attn_mlp") and p.packing.stores_probabilities(q, k, v):
            return finish(_recompute(p.packing.attend, *args, reentrant=p.reentrant))
        return finish(p.packing.attend(*args))

    def _tables(self, p: Pass):
        """The rotary tables of this layer: a sliding-window layer's local ones where the model has them."""
        return (p.local_cos, p.local_sin) if self.window is not None and p.local_cos is not None else (p.cos, p.sin)

    def _heads_core(self, q, k, v, p: Pass, cache, finish):
        """The padded layout's attention core of rotated, head-major q [B, H, L, d], k, v [B, KV, L, d] (after this
        pass's keys and values join the cache's), through `finish`."""
        if cache is not None:
            k, v = cache.update(k, v)
        args = (q, k, v, p.attention_bias if self.window is None else p.window_bias(self.window))
        # core_attn recomputes the probabilities in the backward; the blocked attention's backward does that itself
        # (it keeps only the output and each row's softmax statistics), so the core is not run twice
        if p.recompute in ("core_attn", "core_attn_mlp") and not ops.kernel_switch("attention"):
            return finish(_recompute(self._core, *args, reentrant=p.reentrant))
        return finish(self._core(*args))

    def _core(self, q, k, v, bias):
        """softmax(q k^T * scale + bias) v: q [B, H, L, D], k, v [B, KV, K, D] -> [B, L, H * D]. With
        use_flash_attention the blocked attention (ops.blocked_attention: no probabilities stored), else the
        probabilities materialized (ops.masked_softmax)."""
        batch, heads, length = q.shape[0], q.shape[1], q.shape[2]   # heads: this rank's (context parallel: a share)
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        # heads h = kv * groups + j share kv head `kv`: fold the group into the query axis
        q = q.reshape([batch, kv_heads, groups * length, self.head_dim])
        if ops.kernel_switch("attention"):
            out = ops.blocked_attention(q, k, v, bias, self.scale)
        else:
            out = paddle.matmul(ops.masked_softmax(paddle.matmul(q, k, transpose_y=True), bias, self.scale), v)
        out = out.reshape([batch, heads, length, self.head_dim])
        return out.transpose([0, 2, 1, 3]).reshape([batch, length, heads * self.head_dim])

    @property
    def reads_input_rounded(self) -> bool:
        """Whether the block reads its input only through bfloat16 rounding (its q/k/v projection's)."""
        return self.qkv_proj.reads_input_rounded

    def _decode(self, x, p: Pass, cache: LayerCache):
        """One token per row: split, q/k norm, rotary and the cache write in one kernel, then attention over
        the cache from each row's start slot."""
        slot, inv_freq, start = self.decode_slot(x, p, cache)
        q = ops.rotary_qkv_cache(self.qkv_proj(x), p.position_ids, inv_freq, cache.k, cache.v, self.num_heads,
                                 self.num_kv_heads, slot, *self.qk_norms())
        cache.length = slot + 1
        return ops.decode_attention(q, cache.k, cache.v, start, slot + 1, self.scale)

    def decode_slot(self, x, p: Pass, cache: LayerCache):
        """A decode step's (slot, inverse frequencies, start [B]): the cache slot its token takes (the buffers
        made to hold it), the rotary's frequencies (a sliding-window layer's own where the family has them) and the
        first slot each row attends to."""
        slot = cache.length
        cache.reserve([x.shape[0], self.num_kv_heads, 1, self.head_dim], x.dtype, slot + 1)
        local = self.window is not None and p.local_inv_freq is not None
        start = p.decode_start
        if self.window is not None:  # the row's tokens fill consecutive slots: its last `window` end at `slot`
            start = paddle.maximum(start, paddle.full_like(start, slot + 1 - self.window))
        return slot, p.local_inv_freq if local else p.inv_freq, start

    def qk_norms(self):
        """(q norm's scale, k norm's scale, their epsilon): (None, None, 1e-6) without q/k norms."""
        if not self.qk_norm:
            return None, None, 1e-6
        return self.q_norm.scale, self.k_norm.scale, self.q_norm.eps


class MLP(nn.Layer):
    def __init__(self, config: ModelConfig, tp_group, prefix: str):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = config.family.activation(config)  # silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
        self.gate_up_proj = ColumnLinear(config.hidden_size, [config.intermediate_size] * 2, False, tp_group, prefix,
                                         ("gate_proj", "up_proj"))
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, False, tp_group,
                                   f"{prefix}.down_proj")

    def forward(self, x, p: Optional[Pass] = None):
        tokens = None if p is None else p.tokens  # sequence parallelism: x and the output hold this rank's tokens
        return self.down_proj(self.inner(x, tokens), tokens)

    def inner(self, x, tokens=None):
        """The down projection's input: the gated activation of the gate / up projection."""
        if self.activation == "silu":
            return ops.swiglu(self.gate_up_proj(x, tokens))
        gate, up = paddle.split(self.gate_up_proj(x, tokens), 2, axis=-1)  # a rank's shard is [gate shard, up shard]
        return F.gelu(gate, approximate=True) * up


class DecoderLayer(nn.Layer):
    """Layer `index`: attention, then the MLP, or the sparse MoE block where `moe` (MoESettings) puts one. With the
    family's `sandwich_norms` (Gemma) the attention and MLP outputs are normed too before their residual adds:
    post_attention_layernorm on the attention output, pre_ / post_feedforward_layernorm around the MLP."""

    def __init__(self, config: ModelConfig, tp_group, index: int, moe: Optional[MoESettings] = None):
        super().__init__()
        prefix = f"model.layers.{index}"
        offset, eps = config.family.norm_offset, config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, f"{prefix}.input_layernorm.weight", offset)
        self.self_attn = Attention(config, tp_group, f"{prefix}.self_attn", index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, f"{prefix}.post_attention_layernorm.weight",
                                                offset)
        self.sandwich = config.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps,
                                                     f"{prefix}.pre_feedforward_layernorm.weight", offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps,
                                                      f"{prefix}.post_feedforward_layernorm.weight", offset)
        if moe is not None and moe.sparse(index):
            self.mlp = SparseMoE(config, moe, tp_group, f"{prefix}.mlp")
        else:
            self.mlp = MLP(config, tp_group, f"{prefix}.mlp")

    def forward(self, x, p: Pass, cache=None):
        if p.decode and cache is not None:
            weights = self.decode_weights()
            if weights is not None:   # the whole layer in one kernel call (ops.decode_layer: the same bits)
                slot, inv_freq, start = self.self_attn.decode_slot(x, p, cache)
                out = ops.decode_layer(x, weights, p.position_ids, inv_freq, cache.k, cache.v, start, slot,
                                       p.decode_shared)
                cache.length = slot + 1
                return out
        h = self.input_layernorm(x)
        if cache is None and p.recompute in ("full_attn", "core_attn_mlp") and self.self_attn.reads_input_rounded \
                and not h.stop_gradient:
            # bf16: the attention block reads h only through its products' bfloat16 operands, so the whole block is
            # recomputed from that rounding (which its q/k/v product would keep anyway) instead of keeping q, k, v,
            # the attention output and o_proj's operand
            inner = p.kept()
            x = ops.residual_add(x, recompute_from_bf16(lambda t: self._attn_block(t, inner, None), h))
        elif p.recompute == "full_attn" and cache is None:
            x = ops.residual_add(x, _recompute(self._attn_block, h, p, None, reentrant=p.reentrant))
        else:
            x = ops.residual_add(x, self._attn_block(h, p, cache))
        if p.recompute == "core_attn_mlp" and isinstance(self.mlp, MLP):
            # only the block's input is kept: the norm's output, gate/up and SwiGLU outputs are made again, and the
            # down projection's gradients taken without its forward where _MlpRecompute applies
            if _MlpRecompute.applies(self, x, p):
                return ops.residual_add(x, _MlpRecompute.apply(x, self, p))
            return ops.residual_add(x, _recompute(self._mlp_block, x, p, reentrant=p.reentrant))
        return ops.residual_add(x, self._mlp_block(x, p))

    def decode_weights(self) -> Optional[ops.DecodeLayerWeights]:
        """What ops.decode_layer reads of this layer in a rollout decode step, or None where the layer is not the one
        it runs: sandwich norms, an MoE block, a GeGLU MLP, tensor parallelism, an unmerged LoRA adapter, weights
        without the rollout's packed copies (CausalLM.packed_weights), or PADDLE_RL_FUSED_DECODE_LAYER=0. Made once
        per packing (the packed copies, the norms' scales: CausalLM.packed_weights keeps it until it packs again or
        ends), not at every decode step."""
        if not ops.decode_layer_enabled():
            return None
        weights = self.__dict__.get("_decode_weights")
        if weights is None:   # (a layer the kernel does not take makes None again at each call: a few checks)
            weights = self._make_decode_weights()
            _hold(self, "_decode_weights", weights)
        return weights

    def _make_decode_weights(self) -> Optional[ops.DecodeLayerWeights]:
        attn, mlp = self.self_attn, self.mlp
        if self.sandwich or not isinstance(mlp, MLP) or mlp.activation != "silu":
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.packed is None or m.group is not None
               or (m.lora is not None and m.lora.merged is None and m.lora.enabled) for m in linears):
            return None
        q_norm, k_norm, qk_eps = attn.qk_norms()
        return ops.DecodeLayerWeights(
            self.input_layernorm.scale, attn.qkv_proj.packed, attn.qkv_proj.bias, q_norm, k_norm, attn.o_proj.packed,
            attn.o_proj.bias, self.post_attention_layernorm.scale, mlp.gate_up_proj.packed, mlp.down_proj.packed,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.input_layernorm.weight.shape[0],
            mlp.intermediate_size, self.input_layernorm.eps, qk_eps, attn.scale)

    def _attn_block(self, h, p: Pass, cache=None):
        out = self.self_attn(h, p, cache)
        return self.post_attention_layernorm(out) if self.sandwich else out

    def _mlp_block(self, x, p: Pass):
        if self.sandwich:
            return self.post_feedforward_layernorm(self._mlp(self.pre_feedforward_layernorm(x), p))
        return self._mlp(self.post_attention_layernorm(x), p)

    def _mlp(self, h, p: Pass):
        if p.tokens is not None and isinstance(self.mlp, SparseMoE):
            # sequence parallelism: an MoE block routes every token as under tensor parallelism alone (its router
            # statistics read the pass's token weights), so its input is gathered whole and its output split
            return p.tokens.split(self.mlp(p.tokens.whole(h), p))
        return self.mlp(h, p)

    def sequence_parallel_parameters(self) -> list:
        """The parameters this layer applies to a rank's own tokens under sequence parallelism: its norms, the row
        layers' biases, the LoRA adapters' A of its column layers and B of its row layers."""
        out = [m.weight for m in (self.input_layernorm, self.post_attention_layernorm,
                                  getattr(self, "pre_feedforward_layernorm", None),
                                  getattr(self, "post_feedforward_layernorm", None)) if m is not None]
        for m in self.sublayers():
            if isinstance(m, RowLinear):
                out += [t for t in (m.bias, None if m.lora is None else m.lora.lora_B) if t is not None]
            elif isinstance(m, ColumnLinear) and m.lora is not None:
                out.append(m.lora.lora_A)
        return out


def attention_bias_from_mask(key_mask, query_len: int, causal: bool):
    """Additive bias [B, 1, query_len, key_len]: 0 where a query may attend, NEG_INF elsewhere.

    key_mask [B, key_len] is 1 on real tokens; queries are the last `query_len` keys.
    """
    batch, key_len = key_mask.shape
    zero, banned = paddle.zeros([1], "float32"), paddle.full([1], NEG_INF, "float32")
    keys = paddle.where(key_mask.astype("bool"), zero, banned).reshape([batch, 1, 1, key_len])
    if not (causal and query_len > 1):
        return keys
    q_pos = paddle.arange(key_len - query_len, key_len).unsqueeze(1)
    order = paddle.where(paddle.arange(key_len).unsqueeze(0) <= q_pos, zero, banned)   # [Q, K]
    # both expanded to the full shape first: Paddle's CPU elementwise ops broadcast ~15x slower than they run on
    # operands of one shape (~1.9 against ~0.13 ms at [64, 1, 47, 96])
    shape = [batch, 1, query_len, key_len]
    return paddle.minimum(keys.expand(shape), order.reshape([1, 1, query_len, key_len]).expand(shape))


def position_ids_from_mask(mask):
    """Positions counting only real tokens (left padding gets position 0)."""
    return paddle.clip(paddle.cumsum(mask.astype("int64"), axis=-1) - 1, min=0)


def stage_chunks(num_layers: int, num_stages: int, stage: int, virtual: int = 1) -> List[List[int]]:
    """Layer indices of each chunk a pipeline rank holds, in the order of its virtual stages. `virtual` 1: one
    chunk (`stage_layers`). `virtual` k > 1 (interleaved pipeline, Megatron's assignment): the layers split into
    num_stages x k chunks of consecutive layers, chunk c on rank c % num_stages, so rank r holds chunks r,
    r + num_stages, r + 2 num_stages, ...; the embedding stays with chunk 0 (rank 0), the final norm and head with
    the last chunk (the last rank)."""
    if virtual == 1:
        return [stage_layers(num_layers, num_stages, stage)]
    chunks = num_stages * virtual
    if num_layers % chunks:
        raise ValueError(f"virtual_pp_degree {virtual}: num_hidden_layers ({num_layers}) must be divisible by "
                         f"pipeline_parallel_degree x virtual_pp_degree ({num_stages} x {virtual} = {chunks}): every "
                         "virtual stage holds the same number of layers")
    size = num_layers // chunks
    return [list(range((j * num_stages + stage) * size, (j * num_stages + stage + 1) * size)) for j in range(virtual)]


def stage_layers(num_layers: int, num_stages: int, stage: int) -> List[int]:
    """Layer indices of a pipeline stage: consecutive, sizes differ by at most one (earlier stages take the
    extra)."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_degree {num_stages} exceeds num_hidden_layers {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


class CausalLM(nn.Layer):
    """The decoder with its LM head. `tp_group` (a paddle.distributed group) splits the layers over tensor-parallel
    ranks; `stage=(index, count)` keeps one pipeline stage: its layers, the embedding on the first stage, the
    final norm and head on the last (a tied LM head keeps a copy of the table there, `pp_duplicate`; a sequence
    classifier's score head needs none). `stage=(index, count, virtual)` with virtual k > 1 keeps the rank's k
    chunks of an interleaved pipeline (`stage_chunks`), each run on its own (`run(..., chunk=j)`)."""

    def __init__(self, config: ModelConfig, tp_group=None, stage=(0, 1)):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.stage, self.num_stages, *virtual = stage
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self.chunk_ids = stage_chunks(config.num_hidden_layers, self.num_stages, self.stage, *virtual)
        self.layer_ids = [i for chunk in self.chunk_ids for i in chunk]
        tied = config.tie_word_embeddings
        # a sequence classifier's score head does not read the table: no copy of a tied one on the last stage
        if self.is_first or (self.is_last and tied and not config.sequence_classifier):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp_group,
                                               "model.embed_tokens.weight")
            if not self.is_first:
                self.embed_tokens.weight.pp_duplicate = True  # the first stage's copy counts in the gradient norm
        self.moe = MoESettings.of(config)
        self.layers = nn.LayerList([DecoderLayer(config, tp_group, i, self.moe) for i in self.layer_ids])
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, "model.norm.weight", config.family.norm_offset)
            if config.sequence_classifier:  # a reward model or a critic: a score head, no LM head
                self.score = ScoreHead(config.hidden_size, config.num_labels)  # replicated under tensor parallelism
            elif not tied:
                self.lm_head = ColumnLinear(config.hidden_size, [config.vocab_size], False, tp_group, "",
                                            ("lm_head",), pad=True)
        family = config.family
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope,
                                      float(family.setting(config, "rope_local_base_freq")) if family.sliding else None)
        self.embed_scale = math.sqrt(config.hidden_size) if family.embed_scale else None
        self.logit_softcap = family.logit_softcap(config)
        self.recompute = None   # what training passes recompute in the backward: None | full | full_attn | core_attn
        #                         | core_attn_mlp
        self.recompute_reentrant = False  # Paddle's reentrant recompute instead (recompute_use_reentrant)
        self.no_recompute_layers = frozenset()   # layers (global indices) that keep their activations anyway
        self._router = None
        # sequence parallelism (set by the layout from `sequence_parallel`; needs tp_group): the training and
        # log-prob passes split the residual stream, norms and the embedding's output along the tokens
        self.sequence_parallel = False
        # context parallelism (set_context_parallel, from context_parallel_degree): the group whose ranks split the
        # training and log-prob passes' tokens (Ulysses), None when off
        self.context_group = None
        self.lora = None  # LoraSettings once adapters are on the model (models/lora.py)
        self._packed_head = None  # the tied head's packed table while packed_weights is on
        self.head_bf16 = False  # the LM head's products in bfloat16 (trainer/precision.py; the linears: _Linear.bf16)

    def init_weights(self, std: Optional[float] = None):
        std = self.config.initializer_range if std is None else std
        for name, param in self.named_parameters():
            if "norm" in name:  # 1, or an offset of 0 from it
                param.set_value(paddle.full_like(param, 0.0 if self.config.family.norm_offset else 1.0))
            elif name.endswith("bias"):
                param.set_value(paddle.zeros_like(param))
            else:
                param.set_value(paddle.normal(0.0, std, param.shape).astype(param.dtype))

    def _body_products(self) -> list:
        """The layers of set_bf16's `linears`: every Bf16Products but the heads (the LM head when not tied, the
        score head), which are `head`'s."""
        heads = [m for m in (getattr(self, "lm_head", None), getattr(self, "score", None)) if m is not None]
        return [m for m in self.sublayers() if isinstance(m, Bf16Products) and not any(m is h for h in heads)]

    def set_bf16(self, linears: bool, head: bool) -> None:
        """The compute precision of the products, the parameters kept float32: `linears` every matmul of the body in
        bfloat16 operands with float32 sums (ops.bf16_linear: the column and row layers, their LoRA adapters, the
        MoE router, shared-expert gate and experts; layers.Bf16Products), `head` the LM head's (or a sequence
        classifier's score head: a critic's value head) likewise. trainer/precision.py sets it from `bf16` /
        `use_fp32_compute`. The attention core (q k^T, softmax, p v) is not among them (float32)."""
        for m in self._body_products():
            m.bf16 = bool(linears)
        for m in (getattr(self, "lm_head", None), getattr(self, "score", None)):
            if m is not None:
                m.bf16 = bool(head)
        self.head_bf16 = bool(head)

    def store_linears_bf16(self) -> None:
        """The decoder's linear layers keep their weights in bfloat16 (_Linear.store_weight_bf16): a frozen model
        computing in bf16 (the reference under `bf16: true`). Their products are the same bits; the embedding table
        (a tied LM head's too), an untied LM head, the norms and biases stay float32."""
        for m in self._body_products():
            if isinstance(m, (ColumnLinear, RowLinear)):
                m.store_weight_bf16()

    @property
    def bf16(self):
        """(body products, head) computing with bfloat16 operands (set_bf16)."""
        return any(m.bf16 for m in self._body_products()), self.head_bf16

    def set_recompute(self, what: Optional[str], reentrant: bool = False, keep_layers=()) -> None:
        """What training passes recompute in the backward (None or a recompute_granularity), with Paddle's reentrant
        recompute or not, and the layers that keep their activations whatever `what` says (global indices:
        no_recompute_layers); ValueError for an index the model does not have."""
        layers = self.config.num_hidden_layers
        missing = sorted(i for i in keep_layers if not 0 <= i < layers)
        if missing:
            raise ValueError(f"layers {missing} do not exist: the model has {layers} (0 to {layers - 1})")
        self.recompute, self.recompute_reentrant, self.no_recompute_layers = what, reentrant, frozenset(keep_layers)

    @property
    def recomputes_layers(self) -> bool:
        """Whether a training pass recomputes whole layers or attention blocks (they cannot hand a prompt's keys and
        values, with their autograd history, to a later pass)."""
        return self.training and self.recompute in ("full", "full_attn")

    def new_cache(self, capacity: int = 0, dtype=None) -> List[LayerCache]:
        """One LayerCache per layer of this model; `capacity` (prompt + response slots) preallocates them; `dtype`
        (None: the compute dtype) is what they store."""
        return [LayerCache(capacity, dtype) for _ in self.layers]

    # ---------------------------------------------------------------- the one forward
    def run(self, inputs, p: Pass, chunk: Optional[int] = None):
        """Token ids (first stage) or the previous stage's hidden states -> this stage's hidden states (after the
        final norm on the last stage). `chunk` j: only the rank's j-th chunk of an interleaved pipeline (the
        embedding before chunk 0 of the first rank, the final norm after the last chunk of the last rank)."""
        first, last, own = self._chunk(chunk)
        p.tokens = self._token_split(inputs, p)
        p.context = self._context_split(inputs, p)
        if p.context is not None:   # this rank's slice of the token ids (only a first stage: no pipeline with it)
            inputs = p.context.own(inputs)
        if first:
            x = self.embed_tokens(inputs, p.tokens)
        else:
            x = inputs if p.tokens is None else p.tokens.split(inputs)
        if first and self.embed_scale is not None:  # sqrt(hidden_size) rounded to the embedding dtype
            x = x * paddle.full([], self.embed_scale, dtype=x.dtype)
        p.recompute = self.recompute if self.training and not p.decode else None
        p.reentrant = self.recompute_reentrant
        # no_recompute_layers run with nothing recomputed (the same Pass otherwise: its router statistics are shared)
        kept = p.kept() if p.recompute is not None and self.no_recompute_layers else p
        for i in own:
            layer = self.layers[i]
            lp = kept if self.layer_ids[i] in self.no_recompute_layers else p
            if lp.recompute == "full" and lp.caches is None:
                x = _recompute(layer, x, lp, None, reentrant=lp.reentrant)
            else:
                x = layer(x, lp, lp.cache(i))
        self._router = p.router
        x = self.norm(x) if last else x
        if p.context is not None:  # context parallelism: the output stays this rank's tokens (context_head reads it)
            return x
        # sequence parallelism: the stage's output whole again (the head and the log-prob chunks, a critic's value
        # head and the next stage read every token, as under tensor parallelism alone)
        return x if p.tokens is None else p.tokens.whole(x)

    def _chunk(self, chunk: Optional[int]):
        """(runs the embedding, runs the final norm, local indices of the layers) of `chunk` (None: all)."""
        if chunk is None:
            if len(self.chunk_ids) > 1:
                raise ValueError("an interleaved pipeline stage runs one chunk at a time (run(..., chunk=j))")
            return self.is_first, self.is_last, range(len(self.layers))
        start = sum(len(c) for c in self.chunk_ids[:chunk])
        return (self.is_first and chunk == 0, self.is_last and chunk == len(self.chunk_ids) - 1,
                range(start, start + len(self.chunk_ids[chunk])))

    def _token_split(self, inputs, p: Pass) -> Optional[TokenSplit]:
        """How a pass's tokens split under sequence parallelism, or None: off, a decode step, or a rollout prefill
        into its LayerCaches (the rollout's passes run as under tensor parallelism alone)."""
        if not self.sequence_parallel or self.tp_group is None or p.decode or isinstance(p.cache(0), LayerCache):
            return None
        # the column layers' products keep their own tokens only (gathering them again in the backward) unless a
        # recompute reruns them (Paddle's recompute drops the gradient such a product hands its weight)
        recompute = self.recompute if self.training else None
        return TokenSplit(self.tp_group, inputs.shape[1], keep_own=recompute in (None, "core_attn"))

    def _context_split(self, inputs, p: Pass) -> Optional[ContextSplit]:
        """How a pass's tokens split under context parallelism, or None: off, or a pass whose caller reads the output
        whole (a decode step, a rollout prefill, a reward model's scores: they run whole on every rank)."""
        if self.context_group is None or not p.split_context or p.decode or p.caches is not None:
            return None
        return ContextSplit(self.context_group, inputs.shape[1])

    def set_context_parallel(self, group) -> None:
        """Split the training and log-prob passes' tokens over `group` (context_parallel_degree; None: off). Refused
        by name where the heads cannot split over it, and for sparse MoE blocks (their router statistics and
        load-balancing loss read every token of the pass)."""
        size = group_size(group)
        if size > 1:
            heads, kv = self.config.num_attention_heads, self.config.num_key_value_heads
            if heads % size or (kv % size and size % kv):
                raise ValueError(f"context_parallel_degree {size}: num_attention_heads ({heads}) must be divisible by "
                                 f"it, and num_key_value_heads ({kv}) divisible by it or dividing it (fewer key/value "
                                 "heads are repeated); choose a degree that splits this model's heads")
            if self.moe is not None:
                raise ValueError(f"context_parallel_degree {size}: this model has sparse MoE blocks, whose router "
                                 "statistics and load-balancing loss read every token of a pass; not implemented "
                                 "with a split of the tokens")
            if self.tp_group is not None:
                raise ValueError("context_parallel_degree > 1 with tensor_parallel_degree > 1 is not implemented")
        self.context_group = group if size > 1 else None

    def sequence_parallel_parameters(self) -> list:
        """The parameters every rank holds whole but applies to its own tokens under sequence parallelism (the
        norms outside the attention heads, the row layers' biases, LoRA's A on column and B on row layers): their
        gradients are summed over the tensor-parallel group (parallel/sharding.py GradientSync); [] when off."""
        if not self.sequence_parallel or self.tp_group is None:
            return []
        out = [t for layer in self.layers for t in layer.sequence_parallel_parameters()]
        return out + ([self.norm.weight] if self.is_last else [])

    def tensor_partial_parameters(self) -> list:
        """The parameters every tensor-parallel rank holds whole but whose gradient each computes in part, summed over
        the tensor group by the gradient sync: the q/k norms (each rank normalizes its own heads) and, under sequence
        parallelism, `sequence_parallel_parameters`; [] without tensor parallelism."""
        if self.tp_group is None:
            return []
        heads = [m.weight for layer in self.layers for m in (getattr(layer.self_attn, "q_norm", None),
                                                             getattr(layer.self_attn, "k_norm", None)) if m is not None]
        return heads + self.sequence_parallel_parameters()

    def hidden_states(self, inputs, position_ids, attention_bias, cache=None, token_weight=None,
                      chunk: Optional[int] = None, split_context: bool = False):
        """`token_weight` [B, T]: how much each token counts in the load-balancing loss (None: all once); `chunk`:
        one chunk of an interleaved pipeline stage (run); `split_context`: under context parallelism the output is
        this rank's tokens only (`context_split`), for a caller that reads it through `context_head`."""
        p = Pass(self.rotary, position_ids, attention_bias, cache, token_weight=token_weight)
        p.split_context = split_context
        return self.run(inputs, p, chunk)

    def packed_hidden_states(self, packing, split_context: bool = False):
        """hidden_states [1, N, hidden] of a packed row (packing.Packing: real tokens only, attention per
        segment block); `split_context` as hidden_states."""
        p = Pass(self.rotary, packing.position_ids, token_weight=packing.token_weight, packing=packing)
        p.split_context = split_context
        return self.run(packing.input_ids, p)

    def context_split(self, tokens: int) -> Optional[ContextSplit]:
        """The split of a `tokens`-long pass under context parallelism (what `run` makes), None when off."""
        return None if self.context_group is None else ContextSplit(self.context_group, tokens)

    def sequence_scores(self, input_ids, attention_mask):
        """A sequence classifier's scores [B, num_labels], read at each row's last token that is not the pad token
        (as transformers' `*ForSequenceClassification` reads them; rows right-padded)."""
        hidden = self.hidden_states(input_ids, position_ids_from_mask(attention_mask),
                                    attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True))
        pad = self.config.pad_token_id
        real = (input_ids != pad) if pad is not None else attention_mask.astype("bool")
        positions = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        last = (positions * real.astype("int64")).argmax(axis=-1)
        picked = paddle.take_along_axis(hidden, last.reshape([-1, 1, 1]).expand([-1, 1, hidden.shape[-1]]), axis=1)
        return self.score(picked.squeeze(1))

    # ---------------------------------------------------------------- Mixture-of-Experts load balancing
    def aux_loss(self):
        """The load-balancing loss of the last forward (transformers' `load_balancing_loss_func` over this model's
        MoE layers and the pass's real tokens; differentiable), or None without MoE layers."""
        router = self._router
        return None if router is None or router.counts is None else router.loss()

    @property
    def router_aux_loss_coef(self) -> float:
        """The weight of `aux_loss()` in a training loss: config.json's router_aux_loss_coef when its
        output_router_logits is true (as transformers' MoE models add it to their loss), else 0."""
        return self.moe.aux_loss_coef if self.moe is not None and self.moe.aux_loss_in_training else 0.0

    def decode_step(self, tokens, positions, cache, start, shared=None):
        """Logits [B, V] of the next token after `tokens` [B] at `positions` [B, 1]; appends to `cache`.
        `start` [B] int64: the first cache slot each row attends to (its prompt's first real token). `shared` [B, 2]
        int64 or None: rows whose first slots are the same numbers as another row's (ops.decode_layer)."""
        hidden = self.run(tokens.unsqueeze(-1), Pass(self.rotary, positions, caches=cache, decode_start=start,
                                                     decode_shared=shared))
        return self.logits(hidden).reshape([tokens.shape[0], -1])

    def shared_prompt_hidden_states(self, input_ids, attention_mask, prompt_width: int, prompt_first, prompt_rows):
        """hidden_states of the whole [prompt | response] layout, returned at the response-predicting positions
        [prompt_width - 1, width - 1) only ([b, width - prompt_width, hidden]), with every distinct prompt run
        once: rows `prompt_first` [U] hold the distinct prompts and row i's prompt is distinct prompt
        `prompt_rows[i]`. The responses attend to their prompt's keys and values gathered per row, so the result
        (and its gradient) equals the full pass up to float rounding at a fraction of the prompt cost."""
        prompt_ids, prompt_mask = input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        first_ids, first_mask = paddle.gather(prompt_ids, prompt_first), paddle.gather(prompt_mask, prompt_first)
        recorded = [RecordingCache() for _ in self.layers]
        # the router statistics of both passes together, each distinct prompt counted once per row that has it
        # (MoE blocks read them; nothing does in a dense model)
        router, weight = RouterStats(), None
        if self.moe is not None:
            uses = paddle.bincount(prompt_rows, minlength=first_ids.shape[0]).astype("float32").unsqueeze(-1)
            weight = first_mask.astype("float32") * uses
        prompt_hidden = self.run(first_ids, Pass(self.rotary, position_ids_from_mask(first_mask),
                                                 attention_bias_from_mask(first_mask, prompt_width, causal=True),
                                                 recorded, token_weight=weight, router=router))
        last_prompt = paddle.gather(prompt_hidden[:, -1], prompt_rows).unsqueeze(1)
        response_len = input_ids.shape[1] - prompt_width
        if response_len == 1:
            return last_prompt
        prefixes = [PrefixCache(paddle.gather(c.k, prompt_rows), paddle.gather(c.v, prompt_rows)) for c in recorded]
        response_hidden = self.run(input_ids[:, prompt_width:-1],
                                   Pass(self.rotary, position_ids_from_mask(attention_mask)[:, prompt_width:-1],
                                        attention_bias_from_mask(attention_mask[:, :-1], response_len - 1, causal=True),
                                        prefixes, router=router,
                                        token_weight=None if weight is None else attention_mask[:, prompt_width:-1]))
        return paddle.concat([last_prompt, response_hidden], axis=1)

    # ---------------------------------------------------------------- the head
    @property
    def head_weight(self):
        """The output projection: (weight, transposed) with weight [hidden, V_r], or the tied table [V_r, hidden]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight, True
        return self.lm_head.weight, False

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank's slice (0 without tensor parallelism)."""
        weight, transposed = self.head_weight
        return self.tp_rank * weight.shape[0 if transposed else 1]

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp_group is None else self.tp_group.rank

    @property
    def vocab_width(self) -> int:
        """This rank's number of real vocabulary columns (its slice minus the padding)."""
        weight, transposed = self.head_weight
        per_rank = weight.shape[0 if transposed else 1]
        return max(0, min(per_rank, self.config.vocab_size - self.vocab_start))

    def local_logits(self, hidden):
        """Logits of this rank's padded vocabulary slice (all of it without tensor parallelism)."""
        weight, transposed = self.head_weight
        if not transposed:
            return self.lm_head(hidden)
        hidden = copy_to_group(hidden, self.tp_group)
        if self._packed_head is not None:
            return ops.packed_linear(hidden, self._packed_head, weight.shape[0])
        if self.head_bf16:
            return ops.bf16_linear(hidden, weight.T)
        return paddle.matmul(hidden, weight, transpose_y=True)

    @contextlib.contextmanager
    def packed_weights(self, rollout_dtype: str = "float32", quant_type: str = ""):
        """While on, the linear layers and the LM head multiply by packed copies of their weights (ops/linear.py:
        one contiguous stream per 32 output columns, read once per call; faster than a matmul for the few rows of
        a decode step, and a row's result does not depend on the other rows). The rollout's; the copies (made from
        the weights as they are now, LoRA merged) are dropped on exit, and `repack()` remakes them after the
        weights change. In float32 nothing is packed where the kernel does not run (ops.packing_helps); a
        `rollout_dtype` bfloat16 or a `quant_type` (weight_only_int8 / int4) always packs its format (the pure-Paddle
        reference computes the same products where the kernel does not run). A model training in bf16 (set_bf16)
        decodes in the rollout's precision: float32 products under rollout_dtype float32. The MoE router and
        experts are not packed: they take bfloat16 operands (ops.bf16_linear) where the rollout's activations are
        bfloat16, else float32."""
        fmt, bf16_act = ops.rollout_weight_format(rollout_dtype, quant_type)
        trained_bf16 = self.bf16
        linears = [m for m in self.sublayers() if isinstance(m, (ColumnLinear, RowLinear))]
        unpacked = [m for m in self.sublayers() if isinstance(m, (SparseMoE, Expert))]
        if quant_type and unpacked and not getattr(self, "_said_moe_unquantized", False):
            self._said_moe_unquantized = True   # once per model: the rollout packs at every step
            logger.warning("rollout_quant_type %s quantizes the dense linear layers and the LM head only: the MoE "
                           "routers and experts (%d blocks) are not quantized and multiply in %s", quant_type,
                           sum(isinstance(m, SparseMoE) for m in unpacked), "bfloat16" if bf16_act else "float32")
        head, transposed = self.head_weight if self.is_last and not self.config.sequence_classifier else (None, False)

        def pack(weight, transposed=False):
            if fmt != "float32":
                return ops.pack_weight_lowp(weight, transposed, fmt, bf16_act)
            return ops.pack_weight(weight, transposed) if ops.packing_helps(weight) else None

        def forget_decode_weights():   # what DecoderLayer.decode_weights made from the packed copies
            for layer in self.layers:
                _hold(layer, "_decode_weights", None)

        def repack():
            forget_decode_weights()
            for m in linears:
                _hold(m, "packed", pack(m.effective_weight))
            if transposed:
                _hold(self, "_packed_head", pack(head, transposed=True))
        try:
            self.set_bf16(False, False)
            for m in unpacked:
                m.bf16 = bool(bf16_act)
            repack()
            yield repack
        finally:
            forget_decode_weights()
            for m in linears:
                _hold(m, "packed", None)
                _hold(m, "packed_bias", None)   # ColumnLinear's bias expanded to a decode step's rows
            _hold(self, "_packed_head", None)
            self.set_bf16(*trained_bf16)

    def logits(self, hidden):
        """Full-vocabulary logits (gathered over the tensor-parallel group, padding cut off)."""
        logits = gather_from_group(self.local_logits(hidden), self.tp_group)
        logits = logits if logits.shape[-1] == self.config.vocab_size else logits[..., :self.config.vocab_size]
        return self.softcap(logits)

    def softcap(self, logits):
        """cap * tanh(logits / cap) where the family's config sets a final logit soft cap (Gemma), else logits."""
        cap = self.logit_softcap
        return logits if cap is None else paddle.tanh(logits / cap) * cap

    def head_logprobs(self, hidden, targets, temperature: float, with_entropy: bool = False,
                      with_greedy: bool = False):
        """log softmax(logits / T) at `targets` (and the entropy) from hidden states [b, L, hidden]: [b, L].
        One process: chunked through `ops.lm_head_logprobs` (never a [tokens, vocab] log-softmax), or with
        use_fused_head_and_loss_fn: false from the whole logits (ops.lm_head_logprobs_reference); tensor
        parallel: from vocabulary-sharded logits. `with_greedy` (no-grad passes): a third output, the argmax of
        the logits at each position [b, L] int64."""
        batch, length = targets.shape[0], targets.shape[1]
        weight, transposed = self.head_weight
        if hidden.dtype != paddle.float32:  # AMP's bfloat16 (trainer/precision.py): log-probs from float32 copies
            hidden, weight = hidden.astype("float32"), weight.astype("float32")
        chunked = ops.kernel_switch("head")
        if self.tp_group is None and self.logit_softcap is None:
            head = ops.lm_head_logprobs if chunked is not False else ops.lm_head_logprobs_reference
            out = head(hidden.reshape([batch * length, hidden.shape[-1]]), weight, targets.reshape([-1]), temperature,
                       with_entropy, transpose_weight=transposed, bf16=self.head_bf16, with_greedy=with_greedy)
            return tuple(None if x is None else x.reshape([batch, length]) for x in out)
        if chunked:
            raise ops.SwitchError(self.unchunked_head)
        # tensor parallel, or soft-capped logits: from this rank's logits (all of them in one process)
        logits = self.softcap(self.local_logits(hidden)[..., :self.vocab_width])
        if temperature > 0:
            logits = logits / temperature
        out = vocab_parallel_logprobs(logits, targets, self.tp_group, self.vocab_start, with_entropy)
        return (*out, vocab_parallel_argmax(logits, self.tp_group, self.vocab_start)) if with_greedy else out

    @property
    def unchunked_head(self) -> Optional[str]:
        """Why use_fused_head_and_loss_fn: true cannot act on this model (None where it can)."""
        if self.tp_group is not None:
            return ("use_fused_head_and_loss_fn: true, but under tensor parallelism the log-probs come from each "
                    "rank's vocabulary slice of the logits whole (vocab_parallel_logprobs); set it false or leave it "
                    "unset")
        if self.logit_softcap is not None:
            return ("use_fused_head_and_loss_fn: true, but this model's logits are soft-capped "
                    "(final_logit_softcapping), which the chunked head does not apply; set it false or leave it unset")
        return None

    def forward(self, input_ids, attention_mask=None):
        """Full-sequence logits (no cache): [B, T, vocab]."""
        if attention_mask is None:
            attention_mask = paddle.ones_like(input_ids)
        bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
        hidden = self.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias,
                                    token_weight=attention_mask)
        return self.logits(hidden)
