"""The decoder family: Qwen2/Qwen2.5 (q/k/v bias), Qwen3 (q/k RMSNorm) and Llama, in one definition.

Activations are [batch, tokens, hidden]. q/k/v and gate/up projections are stored fused
(one matmul each); `layout.py` maps them to and from the Hugging Face tensor names.
"""
import math
from typing import List, Optional

import paddle
import paddle.nn as nn

from .. import ops
from ..parallel import tensor_parallel as tp
from .config import ModelConfig

NEG_INF = -1e9


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding:
    """cos/sin tables of rotate-half RoPE for arbitrary position ids."""

    def __init__(self, head_dim: int, theta: float):
        exponents = paddle.arange(0, head_dim, 2, dtype="int64").astype("float32") / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)

    def __call__(self, position_ids):
        freqs = position_ids.astype("float32").unsqueeze(-1) * self.inv_freq
        emb = paddle.concat([freqs, freqs], axis=-1).unsqueeze(2)  # [B, T, 1, head_dim]
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, axis=-1)
    return paddle.concat([-x2, x1], axis=-1)


def apply_rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin (one fused kernel when available)."""
    return ops.rotary(x, cos, sin)


class LayerCache:
    """Keys and values of one layer: buffers k, v [B, kv_heads, capacity, head_dim] allocated once and written
    in place; slots [0, length) hold the tokens seen so far. Without a capacity the buffers grow by doubling."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.k = None
        self.v = None
        self.length = 0

    def update(self, k, v):
        """Append k, v [B, kv_heads, L, head_dim]; returns the filled keys and values."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            self._reserve(k, end)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.keys, self.values

    def _reserve(self, like, needed: int):
        size = max(needed, self.capacity, 2 * (0 if self.k is None else self.k.shape[2]))
        shape = [like.shape[0], like.shape[1], size, like.shape[3]]
        k, v = paddle.zeros(shape, like.dtype), paddle.zeros(shape, like.dtype)
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

    def repeat_interleave(self, n: int):
        if n > 1:
            self.k = paddle.repeat_interleave(self.k, n, axis=0)
            self.v = paddle.repeat_interleave(self.v, n, axis=0)

    def select(self, index):
        self.k = paddle.gather(self.k, index, axis=0)
        self.v = paddle.gather(self.v, index, axis=0)


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


class Attention(nn.Layer):
    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__()
        # this rank's heads: all of them without tensor parallelism
        self.num_heads, self.num_kv_heads = tp.local_heads(config, tp_group)
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.split_sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                            self.num_kv_heads * self.head_dim]
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = tp.column_linear(config.hidden_size, [q_size, kv_size, kv_size], config.attention_bias,
                                         tp_group)
        self.o_proj = tp.row_linear(q_size, config.hidden_size, False, tp_group)
        self.qk_norm = config.uses_qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention_bias, cache: Optional[LayerCache] = None):
        batch, length = x.shape[0], x.shape[1]
        q, k, v = paddle.split(self.qkv_proj(x), self.split_sizes, axis=-1)
        q = q.reshape([batch, length, self.num_heads, self.head_dim])
        k = k.reshape([batch, length, self.num_kv_heads, self.head_dim])
        v = v.reshape([batch, length, self.num_kv_heads, self.head_dim])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin).transpose([0, 2, 1, 3])
        k = apply_rotary(k, cos, sin).transpose([0, 2, 1, 3])
        v = v.transpose([0, 2, 1, 3])
        if cache is not None:
            k, v = cache.update(k, v)
        groups = self.num_heads // self.num_kv_heads
        # heads h = kv * groups + j share kv head `kv`: fold the group into the query axis
        q = q.reshape([batch, self.num_kv_heads, groups * length, self.head_dim])
        probs = ops.masked_softmax(paddle.matmul(q, k, transpose_y=True), attention_bias, self.scale)
        out = paddle.matmul(probs, v).reshape([batch, self.num_heads, length, self.head_dim])
        out = out.transpose([0, 2, 1, 3]).reshape([batch, length, self.num_heads * self.head_dim])
        return self.o_proj(out)


class MLP(nn.Layer):
    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = tp.column_linear(config.hidden_size, [config.intermediate_size] * 2, False, tp_group)
        self.down_proj = tp.row_linear(config.intermediate_size, config.hidden_size, False, tp_group)

    def forward(self, x):
        return self.down_proj(ops.swiglu(self.gate_up_proj(x)))


class DecoderLayer(nn.Layer):
    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp_group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp_group)

    def forward(self, x, cos, sin, attention_bias, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_bias, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_bias_from_mask(key_mask, query_len: int, causal: bool):
    """Additive bias [B, 1, query_len, key_len]: 0 where a query may attend, NEG_INF elsewhere.

    key_mask [B, key_len] is 1 on real tokens; queries are the last `query_len` keys.
    """
    key_len = key_mask.shape[1]
    allowed = key_mask.astype("bool").unsqueeze(1).unsqueeze(1)  # [B,1,1,K]
    if causal and query_len > 1:
        q_pos = paddle.arange(key_len - query_len, key_len).unsqueeze(1)
        k_pos = paddle.arange(key_len).unsqueeze(0)
        allowed = paddle.logical_and(allowed, (k_pos <= q_pos).unsqueeze(0).unsqueeze(0))
    zeros = paddle.zeros(allowed.shape, dtype="float32")
    return paddle.where(allowed, zeros, paddle.full_like(zeros, NEG_INF))


def position_ids_from_mask(mask):
    """Positions counting only real tokens (left padding gets position 0)."""
    return paddle.clip(paddle.cumsum(mask.astype("int64"), axis=-1) - 1, min=0)


class CausalLM(nn.Layer):
    """`tp_group` (a paddle.distributed group) builds the tensor-parallel layers of parallel/tensor_parallel.py."""

    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.embed_tokens = tp.embedding(config.vocab_size, config.hidden_size, tp_group)
        self.layers = nn.LayerList([DecoderLayer(config, tp_group) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        if not config.tie_word_embeddings:
            self.lm_head = tp.column_linear(config.hidden_size, [config.vocab_size], False, tp_group)
        self.recompute = False

    def init_weights(self, std: Optional[float] = None):
        std = self.config.initializer_range if std is None else std
        for name, param in self.named_parameters():
            if "norm" in name:
                param.set_value(paddle.ones_like(param))
            elif name.endswith("bias"):
                param.set_value(paddle.zeros_like(param))
            else:
                param.set_value(paddle.normal(0.0, std, param.shape).astype(param.dtype))

    def hidden_states(self, input_ids, position_ids, attention_bias, cache=None):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        for i, layer in enumerate(self.layers):
            if self.recompute and self.training and cache is None:
                from paddle.distributed.fleet.utils import recompute
                x = recompute(layer, x, cos, sin, attention_bias, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attention_bias, None if cache is None else cache[i])
        return self.norm(x)

    def shared_prompt_hidden_states(self, input_ids, attention_mask, prompt_width: int, prompt_first, prompt_rows):
        """hidden_states of the whole [prompt | response] layout, returned at the response-predicting positions
        [prompt_width - 1, width - 1) only ([b, width - prompt_width, hidden]), with every distinct prompt run
        once: rows `prompt_first` [U] hold the distinct prompts and row i's prompt is distinct prompt
        `prompt_rows[i]`. The responses attend to their prompt's keys and values gathered per row, so the result
        (and its gradient) equals the full pass up to float rounding at a fraction of the prompt cost."""
        prompt_ids, prompt_mask = input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        first_ids, first_mask = paddle.gather(prompt_ids, prompt_first), paddle.gather(prompt_mask, prompt_first)
        recorded = [RecordingCache() for _ in self.layers]
        prompt_hidden = self.hidden_states(first_ids, position_ids_from_mask(first_mask),
                                           attention_bias_from_mask(first_mask, prompt_width, causal=True), recorded)
        last_prompt = paddle.gather(prompt_hidden[:, -1], prompt_rows).unsqueeze(1)
        response_len = input_ids.shape[1] - prompt_width
        if response_len == 1:
            return last_prompt
        prefixes = [PrefixCache(paddle.gather(c.k, prompt_rows), paddle.gather(c.v, prompt_rows)) for c in recorded]
        response_hidden = self.hidden_states(input_ids[:, prompt_width:-1],
                                             position_ids_from_mask(attention_mask)[:, prompt_width:-1],
                                             attention_bias_from_mask(attention_mask[:, :-1], response_len - 1,
                                                                      causal=True), prefixes)
        return paddle.concat([last_prompt, response_hidden], axis=1)

    @property
    def lm_head_weight(self):
        """[hidden, vocab] view of the output projection."""
        return self.embed_tokens.weight.T if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, hidden):
        """Full-vocabulary logits (gathered over the tensor-parallel group)."""
        return tp.gather_from_group(self.local_logits(hidden), self.tp_group)

    def local_logits(self, hidden):
        """Logits of this rank's vocabulary slice (all of it without tensor parallelism)."""
        if self.config.tie_word_embeddings:
            return paddle.matmul(tp.copy_to_group(hidden, self.tp_group), self.embed_tokens.weight, transpose_y=True)
        return self.lm_head(hidden)

    def forward(self, input_ids, attention_mask=None):
        """Full-sequence logits (no cache): [B, T, vocab]."""
        if attention_mask is None:
            attention_mask = paddle.ones_like(input_ids)
        bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
        hidden = self.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias)
        return self.logits(hidden)
