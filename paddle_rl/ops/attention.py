"""One decode step of grouped-query attention against a preallocated KV cache."""
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
