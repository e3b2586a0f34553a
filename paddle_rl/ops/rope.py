"""Rotate-half rotary embedding; the training passes' fused bias + split + rotary + head-major layout of q/k/v
(qkv_rotary); the decode step's fused split + (q/k norm) + rotary + KV-cache write."""
from typing import Optional

import paddle

from . import build
from ._util import contiguous, cpu_build, env_on, fusable
from .kv_cache import caches_fusable
from .norm import rms_norm_reference
from .switches import switch, unusable


def rotate_half(x):
    x1, x2 = x.chunk(2, axis=-1)
    return paddle.concat([-x2, x1], axis=-1)


def rotary_reference(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rotary_fused(x, cos, sin):
    """x [B, L, H, D], cos/sin [B or 1, L, 1, D]; differentiable in x."""
    return build.run("prl_rotary", contiguous(x), contiguous(cos), contiguous(sin))[0]


def rotary(x, cos, sin):
    """The kernel, or the composed ops, as use_fused_rope says (switches.py; unset: the kernel where it runs)."""
    use = switch("rope")
    if use is False:
        return rotary_reference(x, cos, sin)
    layout = x.ndim == 4 and cos.ndim == 4 and cos.shape[2] == 1 and cos.shape[0] in (1, x.shape[0]) \
        and cos.shape[1] == x.shape[1]
    if layout and fusable(x, cos, sin):
        return rotary_fused(x, cos, sin)
    if use:
        raise unusable("rope", f"x {x.shape} {x.dtype}, tables {cos.shape}: the kernel takes float32 x [B, L, H, D] "
                               "and tables [B or 1, L, 1, D]")
    return rotary_reference(x, cos, sin)


def qkv_rotary_reference(qkv, bias, cos, sin, num_heads: int, num_kv_heads: int):
    """The training passes' attention input: the fused projection qkv [B, L, (H + 2 KV) * D] plus its bias (or None),
    split, q and k rotated (`rotary`: tables [B or 1, L, 1, D]), each head-major: q [B, H, L, D], k, v [B, KV, L, D]."""
    if bias is not None:
        qkv = qkv + bias
    batch, length = qkv.shape[0], qkv.shape[1]
    d = qkv.shape[2] // (num_heads + 2 * num_kv_heads)
    q, k, v = paddle.split(qkv, [num_heads * d, num_kv_heads * d, num_kv_heads * d], axis=-1)
    q = rotary(q.reshape([batch, length, num_heads, d]), cos, sin)
    k = rotary(k.reshape([batch, length, num_kv_heads, d]), cos, sin)
    v = v.reshape([batch, length, num_kv_heads, d])
    return q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])


_NO_BIAS = {}   # the empty float32 tensor prl_qkv_rotary takes for "no bias", made once


def qkv_rotary_fused(qkv, bias, cos, sin, num_heads: int, num_kv_heads: int):
    """The kernel: one pass over the projection, and one back (the bias's gradient summed in it); the same bits as
    the reference, forward and backward."""
    if bias is None:
        bias = _NO_BIAS.get("t")
        if bias is None:
            bias = _NO_BIAS["t"] = paddle.zeros([0], "float32")
    out = build.run("prl_qkv_rotary", contiguous(qkv), bias, contiguous(cos), contiguous(sin), int(num_heads),
                    int(num_kv_heads))
    return out[0], out[1], out[2]


def qkv_rotary_runs(cos, *tensors) -> bool:
    """Whether prl_qkv_rotary takes these tensors (the projection's input, weight and bias, or its output and bias,
    and the tables): neither use_fused_rope nor use_fused_linear false (the kernel adds the bias: under
    use_fused_linear: false the product and the bias add stay separate ops), PADDLE_RL_FUSED_QKV not 0 (for
    comparisons), no autocast, tables [., ., 1, D], float32 tensors on the CPU (the kernel has no CUDA counterpart)
    and the kernels in use."""
    if switch("rope") is False or switch("linear") is False or not env_on("PADDLE_RL_FUSED_QKV"):
        return False
    if paddle.amp.is_autocast_enabled() or cos.ndim != 4 or cos.shape[2] != 1:
        return False
    if not cpu_build() and not all(t.place.is_cpu_place() for t in (cos, *tensors) if t is not None):
        return False
    return fusable(cos, *tensors)


def qkv_rotary(qkv, bias, cos, sin, num_heads: int, num_kv_heads: int):
    """The kernel where qkv_rotary_runs says it runs on these tensors (and the tables fit them), else the composed
    ops (whose rotary raises with use_fused_rope: true where its kernel cannot run)."""
    fits = qkv.ndim == 3 and cos.shape[0] in (1, qkv.shape[0]) and cos.shape[1] == qkv.shape[1]
    if fits and qkv_rotary_runs(cos, qkv, bias, sin):
        return qkv_rotary_fused(qkv, bias, cos, sin, num_heads, num_kv_heads)
    return qkv_rotary_reference(qkv, bias, cos, sin, num_heads, num_kv_heads)


def rotary_tables(positions, inv_freq):
    """cos, sin [B, L, 1, D] of positions [B, L] and inverse frequencies [D / 2]."""
    freqs = positions.astype("float32").unsqueeze(-1) * inv_freq
    emb = paddle.concat([freqs, freqs], axis=-1).unsqueeze(2)
    return emb.cos(), emb.sin()


def rotary_qkv_cache_reference(qkv, positions, inv_freq, cache_k, cache_v, num_heads: int, num_kv_heads: int,
                               slot: int, q_norm=None, k_norm=None, eps: float = 1e-6):
    """Split qkv [B, L, (H + 2 KV) * D]; return rotated q [B, L, H, D]; write rotated k and v into the caches
    [B, KV, C, D] at slots slot .. slot + L - 1 (in place; cast to the caches' dtype)."""
    batch, length = qkv.shape[0], qkv.shape[1]
    d = cache_k.shape[3]
    q, k, v = paddle.split(qkv, [num_heads * d, num_kv_heads * d, num_kv_heads * d], axis=-1)
    q = q.reshape([batch, length, num_heads, d])
    k = k.reshape([batch, length, num_kv_heads, d])
    v = v.reshape([batch, length, num_kv_heads, d])
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    cos, sin = rotary_tables(positions, inv_freq)
    q = rotary_reference(q, cos, sin)
    k = rotary_reference(k, cos, sin)
    cache_k[:, :, slot:slot + length] = k.transpose([0, 2, 1, 3]).astype(cache_k.dtype)
    cache_v[:, :, slot:slot + length] = v.transpose([0, 2, 1, 3]).astype(cache_v.dtype)
    return q


def rotary_qkv_cache_fused(qkv, positions, inv_freq, cache_k, cache_v, num_heads: int, num_kv_heads: int,
                           slot: int, q_norm=None, k_norm=None, eps: float = 1e-6):
    return build.run("prl_rotary_qkv_cache", contiguous(qkv), positions, inv_freq, cache_k, cache_v, q_norm, k_norm,
                     int(num_heads), int(num_kv_heads), int(slot), float(eps))[0]


def rotary_qkv_cache(qkv, positions, inv_freq, cache_k, cache_v, num_heads: int, num_kv_heads: int, slot: int,
                     q_norm: Optional[paddle.Tensor] = None, k_norm: Optional[paddle.Tensor] = None,
                     eps: float = 1e-6):
    fused = fusable(qkv, q_norm) and caches_fusable(cache_k, cache_v)
    fn = rotary_qkv_cache_fused if fused else rotary_qkv_cache_reference
    return fn(qkv, positions, inv_freq, cache_k, cache_v, num_heads, num_kv_heads, slot, q_norm, k_norm, eps)
