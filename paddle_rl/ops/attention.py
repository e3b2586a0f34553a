"""Grouped-query attention: one decode step against a preallocated KV cache, the masked softmax of the padded
training / prefill path, and the attention of a packed row (several sequences in one row, with its backward)."""
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from . import build
from ._util import FLOAT32, contiguous, fusable
from .kv_cache import DTYPES as KV_DTYPES, caches_fusable

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


def decode_attention_reads_windows(q_dtype, cache_dtype) -> bool:
    """Whether decode_attention of a q_dtype query over cache_dtype caches on the default device runs the kernel,
    which reads each row's slots start[b] .. length - 1 only (the reference reads every slot below `length`, the
    ones before a row's start masked: they must hold finite numbers). What `decode_attention` checks on its tensors,
    read ahead of them (the rollout engine's buffers)."""
    return (paddle.in_dynamic_mode() and q_dtype in FLOAT32 and cache_dtype in KV_DTYPES
            and paddle.get_device().split(":")[0] in ("cpu", "gpu") and build.available())


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


# ------------------------------------------------------------------------- blocked attention (use_flash_attention)
# The training / prefill attention of the padded layout without its probabilities: query rows in blocks of at most
# BLOCK_ELEMENTS scores, each block's softmax(QK^T) made, multiplied by V and dropped; the forward keeps the output
# and each row's maximum and sum of exponentials, and the backward makes each block's probabilities again from them
# (FlashAttention's recomputation: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K, dK = dS^T Q,
# with the scale). The maximum is kept beside the sum (not their log-sum-exp) so that a row whose keys are all
# masked (left padding: every score near NEG_INF, where float32's spacing is 64) makes the forward's probabilities
# again exactly.
BLOCK_ELEMENTS = 1 << 22   # scores per block (16 MB of float32)


def blocked_attention_reference(q, k, v, bias, scale: float):
    """softmax(q k^T * scale + bias) v with the probabilities materialized: q [B, KV, G * L, D] (a kv head's G query
    heads folded into the rows), k, v [B, KV, K, D], bias [B or 1, 1, L, K] -> [B, KV, G * L, D]."""
    probs = masked_softmax_reference(paddle.matmul(q, k, transpose_y=True), bias, scale)
    return paddle.matmul(probs, v)


def _block_rows(q, keys: int, length: int, rows: int = 0) -> int:
    if rows:
        return max(1, min(int(rows), length))
    batch, kv, folded = q.shape[0], q.shape[1], q.shape[2]
    groups = folded // length
    return max(1, min(length, BLOCK_ELEMENTS // max(1, batch * kv * groups * keys)))


def _scores(qb, k, bias_b, scale: float):
    """Scores of a block: qb [B, KV, G, b, D] against k [B, KV, K, D], bias_b [B or 1, 1, b, K]."""
    return paddle.matmul(qb, k.unsqueeze(2), transpose_y=True) * scale + bias_b.unsqueeze(2)


def _blocked_forward(q, k, v, bias, scale: float, rows: int, keep: bool):
    batch, kv, folded, d = q.shape
    length = bias.shape[2]
    q5 = q.reshape([batch, kv, folded // length, length, d])
    outs, tops, sums = [], [], []
    for start in range(0, length, rows):
        stop = min(start + rows, length)
        s = _scores(q5[:, :, :, start:stop], k, bias[:, :, start:stop], scale)
        top = s.max(axis=-1, keepdim=True)
        e = (s - top).exp()
        total = e.sum(axis=-1, keepdim=True)
        outs.append(paddle.matmul(e / total, v.unsqueeze(2)))
        if keep:
            tops.append(top)
            sums.append(total)
    cat = (lambda xs: xs[0] if len(xs) == 1 else paddle.concat(xs, axis=3))
    out = cat(outs).reshape([batch, kv, folded, d])
    return (out, cat(tops), cat(sums)) if keep else (out, None, None)


class _BlockedAttention(PyLayer):
    @staticmethod
    def forward(ctx, q, k, v, bias, scale, rows):
        ctx.needs = (not q.stop_gradient, not k.stop_gradient, not v.stop_gradient)
        out, top, total = _blocked_forward(q, k, v, bias, scale, rows, keep=True)
        ctx.save_for_backward(q, k, v, bias, out, top, total)
        ctx.config = (scale, rows)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, top, total = ctx.saved_tensor()
        scale, rows = ctx.config
        batch, kv, folded, d = q.shape
        length = bias.shape[2]
        groups = folded // length
        q5 = q.reshape([batch, kv, groups, length, d])
        g5 = grad_out.reshape([batch, kv, groups, length, d])
        delta = (g5 * out.reshape([batch, kv, groups, length, d])).sum(axis=-1, keepdim=True)
        dq, dk, dv = [], None, None
        for start in range(0, length, rows):
            stop = min(start + rows, length)
            qb, gb = q5[:, :, :, start:stop], g5[:, :, :, start:stop]
            p = (_scores(qb, k, bias[:, :, start:stop], scale) - top[:, :, :, start:stop]).exp() \
                / total[:, :, :, start:stop]
            ds = p * (paddle.matmul(gb, v.unsqueeze(2), transpose_y=True) - delta[:, :, :, start:stop]) * scale
            dq.append(paddle.matmul(ds, k.unsqueeze(2)))
            flat = [batch, kv, groups * (stop - start), -1]   # a kv head's query heads summed in one product
            dv_b = paddle.matmul(p.reshape(flat), gb.reshape(flat), transpose_x=True)
            dk_b = paddle.matmul(ds.reshape(flat), qb.reshape(flat), transpose_x=True)
            dv = dv_b if dv is None else dv.add_(dv_b)
            dk = dk_b if dk is None else dk.add_(dk_b)
        dq = (dq[0] if len(dq) == 1 else paddle.concat(dq, axis=3)).reshape([batch, kv, folded, d])
        return (dq if ctx.needs[0] else None, dk if ctx.needs[1] else None, dv if ctx.needs[2] else None, None)


def blocked_attention(q, k, v, bias, scale: float, rows: int = 0):
    """blocked_attention_reference's result without its [B, KV, G * L, K] probabilities: query rows in blocks
    (`rows` positions per block; 0: as many as BLOCK_ELEMENTS scores allow), the backward making each block's
    probabilities again from the saved row maxima and sums. Differentiable in q, k and v (not the bias)."""
    rows = _block_rows(q, k.shape[2], bias.shape[2], rows)
    if paddle.is_grad_enabled() and not (q.stop_gradient and k.stop_gradient and v.stop_gradient):
        return _BlockedAttention.apply(q, k, v, bias, float(scale), rows)
    return _blocked_forward(q, k, v, bias, float(scale), rows, keep=False)[0]
