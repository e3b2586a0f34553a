"""One decoder layer of a rollout decode step (one token per row) as one kernel call: the dense pre-norm layer of
the Llama / Qwen2 / Qwen3 families (SwiGLU MLP, optional q/k/v and output biases, optional q/k norms).

The reference is the layer as ten op calls (RMSNorm, the packed q/k/v product and its bias, rotary with the
cache write, decode attention, the output product, the residual add, RMSNorm, the gate/up product, SwiGLU, the
down product and the residual add); the kernel (csrc/cpu/decode_layer.cc) runs the same kernels in the same order
in one call, the same bits, without the nine other dispatches (~16-35 us each alone on a CPU, 50-300 us in a
decode step). The weights are the rollout's packed copies (`pack_weight`'s float32 panels or a `LowpPacked`). The
model uses it for every layer that has this shape (models/decoder.py DecoderLayer.decode_weights);
PADDLE_RL_FUSED_DECODE_LAYER=0 runs the layers' own modules instead (for comparisons)."""
from dataclasses import dataclass
from typing import Optional, Union

import paddle

from . import build
from ._util import contiguous, cpu_build, env_on, fusable
from .activation import swiglu
from .attention import decode_attention
from .kv_cache import caches_fusable
from .linear import LowpPacked, packed_linear
from .norm import rms_norm
from .rope import rotary_qkv_cache
from .switches import switch

Packed = Union[paddle.Tensor, LowpPacked]


@dataclass
class DecodeLayerWeights:
    """What one layer's decode step reads: the norms' scales, the packed products (qkv [hidden -> (H + 2 KV) d],
    o [H d -> hidden], gate_up [hidden -> 2 intermediate] as [gate | up], down [intermediate -> hidden]), the
    biases and q/k norms a family has (else None), the attention's shape and the norms' epsilons."""
    in_norm: paddle.Tensor
    qkv: Packed
    qkv_bias: Optional[paddle.Tensor]
    q_norm: Optional[paddle.Tensor]
    k_norm: Optional[paddle.Tensor]
    o: Packed
    o_bias: Optional[paddle.Tensor]
    post_norm: paddle.Tensor
    gate_up: Packed
    down: Packed
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float
    qk_eps: float
    scale: float


def enabled() -> bool:
    """Whether the model runs its decode layers through `decode_layer` (PADDLE_RL_FUSED_DECODE_LAYER, default on)."""
    return env_on("PADDLE_RL_FUSED_DECODE_LAYER")


def decode_layer_reference(x, w: DecodeLayerWeights, positions, inv_freq, cache_k, cache_v, start, slot: int,
                           shared=None):
    """x [B, 1, hidden] -> the layer's output [B, 1, hidden]; keys and values written into the caches
    [B, KV, C, D] at `slot`; row b attends to slots start[b] .. slot. positions [B, 1], start [B] int64.
    `shared` [B, 2] int64 (or None): row b's slots start[b] .. shared[b, 1] - 1 hold the same keys and values as
    row shared[b, 0]'s (the samples of one prompt); the kernel reads them from there, once from memory for all the
    rows that share them (the same numbers, so the same result); the reference reads every row's own."""
    qkv = packed_linear(rms_norm(x, w.in_norm, w.eps), w.qkv, (w.num_heads + 2 * w.num_kv_heads) * w.head_dim)
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    q = rotary_qkv_cache(qkv, positions, inv_freq, cache_k, cache_v, w.num_heads, w.num_kv_heads, slot, w.q_norm,
                         w.k_norm, w.qk_eps)
    out = packed_linear(decode_attention(q, cache_k, cache_v, start, slot + 1, w.scale), w.o, w.hidden)
    if w.o_bias is not None:
        out = out + w.o_bias
    x = out + x
    up = packed_linear(rms_norm(x, w.post_norm, w.eps), w.gate_up, 2 * w.intermediate)
    return packed_linear(swiglu(up), w.down, w.hidden) + x


def _pack_args(packed: Packed):
    """(data, scales or None) of a packed weight."""
    return (packed.data, packed.scales) if isinstance(packed, LowpPacked) else (packed, None)


def _bf16_act(w: DecodeLayerWeights) -> bool:
    return any(isinstance(p, LowpPacked) and p.bf16_act for p in (w.qkv, w.o, w.gate_up, w.down))


def decode_layer_fused(x, w: DecodeLayerWeights, positions, inv_freq, cache_k, cache_v, start, slot: int,
                       shared=None):
    return build.run("prl_decode_layer", contiguous(x), w.in_norm, *_pack_args(w.qkv), w.qkv_bias, positions,
                     inv_freq, cache_k, cache_v, start, w.q_norm, w.k_norm, *_pack_args(w.o), w.o_bias, w.post_norm,
                     *_pack_args(w.gate_up), *_pack_args(w.down), shared, int(w.num_heads), int(w.num_kv_heads),
                     int(w.intermediate), int(slot), int(slot) + 1, float(w.eps), float(w.qk_eps), float(w.scale),
                     _bf16_act(w))[0]


def fused_runs(x, w: DecodeLayerWeights, cache_k, cache_v) -> bool:
    """The kernel takes these: float32 activations, norms and biases, caches of a kernel dtype, every tensor on
    the CPU, the mixed formats of one rollout (all float32 panels, or all one low-precision pack) and RMSNorm's
    kernel not switched off (use_fused_rms_norm: false composes it, other bits)."""
    if switch("rms_norm") is False or not caches_fusable(cache_k, cache_v):
        return False
    if not fusable(x, w.in_norm, w.post_norm, w.qkv_bias, w.o_bias, w.q_norm, w.k_norm):
        return False
    packs = (w.qkv, w.o, w.gate_up, w.down)
    if len({type(p) for p in packs}) != 1 or len({isinstance(p, LowpPacked) and p.bf16_act for p in packs}) != 1:
        return False
    if cpu_build():
        return True
    return all(t.place.is_cpu_place() for t in (x, cache_k, *(_pack_args(p)[0] for p in packs)))


def decode_layer(x, w: DecodeLayerWeights, positions, inv_freq, cache_k, cache_v, start, slot: int, shared=None):
    """The kernel where it runs (fused_runs), else the reference."""
    fn = decode_layer_fused if fused_runs(x, w, cache_k, cache_v) else decode_layer_reference
    return fn(x, w, positions, inv_freq, cache_k, cache_v, start, slot, shared)
