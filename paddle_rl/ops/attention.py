"""Grouped-query attention: one decode step against a preallocated KV cache, the masked softmax of the padded
training / prefill path, and the attention of a packed row (several sequences in one row, with its backward)."""
import paddle
import paddle.nn.functional as F

from . import build
from ._util import contiguous, fusable
from .kv_cache import caches_fusable

NEG_INF = -1e9


def decode_attention_reference(q, cache_k, cache_v, start, length: int, scale: float):
    """q [B, 1, H, D]; caches [B, KV, C, D] (float32, or a 16-bit dtype read as q's); row b attends to slots
    start[b] .. length - 1. Returns [B, 1, H * D] (query head h uses kv head h // (H / KV), as in the decoder's
    Attention)."""
    batch, heads, d = q.shape[0], q.shape[2], q.shape[3]
    kv = cache_k.shape[1]
    k, v = cache_k[:, :, :length].astype(q.dtype), cache_v[:, :, :length].astype(q.dtype)
    qh = q.reshape([batch, kv, heads // kv, d])
    scores = paddle.matmul(qh, k, transpose_y=True) * scale
    valid = paddle.arange(length, dtype="int64").unsqueeze(0) >= start.unsqueeze(-1)
    bias = paddle.where(valid, paddle.zeros(valid.shape, "float32"), paddle.full(valid.shape, NEG_INF, "float32"))
    probs = F.softmax(scores + bias.unsqueeze(1).unsqueeze(1), axis=-1)
    return paddle.matmul(probs, v).reshape([batch, 1, heads * d])


def decode_attention_fused(q, cache_k, cache_v, start, length: int, scale: float):
    return build.run("prl_decode_attention", contiguous(q), cache_k, cache_v, start, int(length), float(scale))[0]


def decode_attention(q, cache_k, cache_v, start, length: int, scale: float):
    fn = decode_attention_fused if fusable(q) and caches_fusable(cache_k, cache_v) else decode_attention_reference
    return fn(q, cache_k, cache_v, start, length, scale)


def masked_softmax_reference(scores, bias, scale: float):
    """softmax(scale * scores + bias) over the last axis: scores [B, H, G * L, K] with each kv head's G query
    heads folded into the rows, bias [B, 1, L, K] shared by every head."""
    batch, heads, rows, keys = scores.shape
    length = bias.shape[2]
    z = (scores * scale).reshape([batch, heads, rows // length, length, keys]) + bias.unsqueeze(2)
    return F.softmax(z, axis=-1).reshape([batch, heads, rows, keys])


def masked_softmax_fused(scores, bias, scale: float):
    """The CPU kernel (with its backward; no gradient for the bias)."""
    return build.run("prl_masked_softmax", contiguous(scores), contiguous(bias), float(scale))[0]


def _kernel_layout(scores, bias) -> bool:
    """bias is [B or 1, 1, L, K] with L dividing the score rows (what the kernel indexes)."""
    if len(scores.shape) != 4 or len(bias.shape) != 4:
        return False
    (batch, _, rows, keys), (b_batch, b_heads, length, b_keys) = scores.shape, bias.shape
    return b_batch in (batch, 1) and b_heads == 1 and b_keys == keys and length > 0 and rows % length == 0


def masked_softmax(scores, bias, scale: float):
    if (fusable(scores, bias) and scores.place.is_cpu_place() and bias.stop_gradient
            and _kernel_layout(scores, bias)):
        return masked_softmax_fused(scores, bias, scale)
    return masked_softmax_reference(scores, bias, scale)


def packed_key_mask(spans):
    """[N, N] bool: token t attends to key j (spans [N, 4]: prefix_begin, prefix_end, segment_begin, query_end)."""
    n = spans.shape[0]
    j = paddle.arange(n, dtype="int64").unsqueeze(0)
    t = j.reshape([n, 1])
    prefix = (j >= spans[:, 0:1]) & (j < spans[:, 1:2])
    return prefix | ((j >= spans[:, 2:3]) & (j <= t))


def packed_attention_reference(q, k, v, spans, scale: float):
    """Attention of a packed row: q [N, H, D], k, v [N, KV, D]; token t attends to keys [prefix_begin, prefix_end)
    and [segment_begin, t] of spans [N, 4] int64 (its last column, the end of the queries that attend to each
    key, is the kernel's; models/packing.py). Returns [N, H * D]. Dense: N x N scores per head."""
    n, heads, d = q.shape
    kv = k.shape[1]
    bias = paddle.where(packed_key_mask(spans), paddle.zeros([n, n], "float32"),
                        paddle.full([n, n], NEG_INF, "float32"))
    qh = q.transpose([1, 0, 2]).reshape([kv, heads // kv * n, d])  # a kv head's query heads folded into the rows
    scores = paddle.matmul(qh, k.transpose([1, 0, 2]), transpose_y=True).reshape([kv, heads // kv, n, n])
    probs = F.softmax(scores * scale + bias, axis=-1).reshape([kv, heads // kv * n, n])
    out = paddle.matmul(probs, v.transpose([1, 0, 2])).reshape([heads, n, d])
    return out.transpose([1, 0, 2]).reshape([n, heads * d])


def packed_attention_fused(q, k, v, spans, scale: float):
    """The CPU kernel (csrc/cpu/attention.cc): the forward keeps out and each row's log-sum-exp, the backward
    recomputes the probabilities (no [N, keys] tensor is stored)."""
    return build.run("prl_packed_attention", contiguous(q), contiguous(k), contiguous(v), spans, float(scale))[0]


def packed_attention_usable(q, k, v) -> bool:
    """The CPU kernel's case: float32 CPU tensors, head_dim a multiple of 16 (its vectors)."""
    return fusable(q, k, v) and q.place.is_cpu_place() and q.shape[-1] % 16 == 0
