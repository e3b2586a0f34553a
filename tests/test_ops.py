"""The fused kernels of csrc/ against their pure-Paddle references, on fresh random inputs.

Tolerances (float32): RMSNorm, rotary, attention and their gradients 1e-5 relative to the output scale;
sampled tokens exactly equal (both paths draw in float64), their log-probs 2e-5; the chunked LM-head
log-prob / entropy 2e-5 and gradients 1e-4 relative to the gradient scale. The library is built (or found in
the cache) once for the module.
"""
import functools
import json
import logging
import os
import re
import subprocess
import sys
import zlib

import numpy as np
import paddle
import pytest

from paddle_rl import ops
from paddle_rl.config import load_config
from paddle_rl.models import CausalLM, ModelConfig
from paddle_rl.models.decoder import (MLP, Attention, DecoderLayer, _MlpRecompute, attention_bias_from_mask,
                                     mlp_recompute_reruns_down)
from paddle_rl.models.layers import RowLinear
from paddle_rl.models.logprobs import token_logprobs
from paddle_rl.models.packing import Packing
from paddle_rl.ops import build, kv_cache
from paddle_rl.ops import logprob as logprob_module
from paddle_rl.trainer.loop import StepLoop

SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    previous = build.mode()
    ops.configure("on")          # builds (about 15 s) or loads the cached library; fails loudly if it cannot
    yield
    ops.configure(previous)


@pytest.fixture
def rng(request):
    # a stable seed per test (str's hash() differs from process to process)
    return np.random.default_rng([SEED, zlib.crc32(request.node.name.encode())])


def t(array, dtype="float32", grad=False):
    out = paddle.to_tensor(np.asarray(array).astype(dtype))
    out.stop_gradient = not grad
    return out


def close(actual, expected, rel=1e-5, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max()) if expected.size else 1.0)
    err = float(np.abs(actual - expected).max()) if expected.size else 0.0
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:g} x {scale:.3g} (seed {SEED})"


# ------------------------------------------------------------------------------------------------ RMSNorm

# the last case of each kernel is large enough for its rows to be split across threads
@pytest.mark.parametrize("shape", [(3, 7, 64), (1, 1, 256), (5, 24), (9, 100, 320)])
def test_rms_norm_and_gradients(rng, shape):
    x = t(rng.standard_normal(shape) * 3, grad=True)
    w = t(rng.standard_normal(shape[-1]), grad=True)
    fused, ref = ops.rms_norm_fused(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6)
    close(fused.numpy(), ref.numpy(), what="rms_norm")
    g = t(rng.standard_normal(shape))
    for a, b, name in zip(paddle.grad(fused, [x, w], g), paddle.grad(ref, [x, w], g), ("dx", "dw")):
        close(a.numpy(), b.numpy(), what=f"rms_norm {name}")


# ------------------------------------------------------------------------------------------------ rotary

def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (paddle.arange(0, d, 2, dtype="int64").astype("float32") / d))


# the last case's rows are split over the threads
@pytest.mark.parametrize("batch,length,heads,d,table_batch", [(2, 9, 4, 32, 2), (1, 1, 2, 64, 1), (3, 5, 2, 16, 1),
                                                               (4, 600, 4, 32, 4)])
def test_rotary_and_gradient(rng, batch, length, heads, d, table_batch):
    x = t(rng.standard_normal((batch, length, heads, d)), grad=True)
    cos, sin = ops.rotary_tables(paddle.to_tensor(rng.integers(0, 4000, (table_batch, length))), _inv_freq(d))
    fused, ref = ops.rotary_fused(x, cos, sin), ops.rotary_reference(x, cos, sin)
    close(fused.numpy(), ref.numpy(), what="rotary")
    g = t(rng.standard_normal(x.shape))
    close(paddle.grad(fused, x, g)[0].numpy(), paddle.grad(ref, x, g)[0].numpy(), what="rotary dx")


def _qkv_rotary_pass(fn, qkv, bias, cos, sin, heads, kv, grads):
    """q, k, v and the gradients of qkv (and of the bias, when there is one) for the output gradients `grads`."""
    q, k, v = fn(qkv, bias, cos, sin, heads, kv)
    inputs = [qkv] + ([bias] if bias is not None else [])
    return [o.numpy() for o in (q, k, v)] + [g.numpy() for g in paddle.grad([q, k, v], inputs, grads)]


# (batch, length, heads, kv heads, d, table batch, bias); the last two cases' rows are split over the threads, and
# so are the bias gradient's columns
@pytest.mark.parametrize("batch,length,heads,kv,d,table_batch,bias", [
    (2, 9, 4, 2, 32, 2, True), (1, 1, 2, 2, 64, 1, True), (3, 5, 2, 1, 16, 1, False), (64, 48, 4, 2, 32, 64, True),
    (4, 300, 6, 2, 64, 1, False)])
def test_qkv_rotary_is_its_ops_bit_for_bit(rng, batch, length, heads, kv, d, table_batch, bias):
    """The training passes' bias + split + rotary + head-major layout in one kernel: the same bits as the composed
    ops (Paddle's add, split and transposes around the rotary kernel), forward and backward, the bias's gradient
    (Paddle's row-order sum) too."""
    width = (heads + 2 * kv) * d
    qkv = t(rng.standard_normal((batch, length, width)), grad=True)
    b = t(rng.standard_normal(width), grad=True) if bias else None
    cos, sin = ops.rotary_tables(paddle.to_tensor(rng.integers(0, 4000, (table_batch, length))), _inv_freq(d))
    grads = [t(rng.standard_normal(shape)) for shape in
             ((batch, heads, length, d), (batch, kv, length, d), (batch, kv, length, d))]
    fused = _qkv_rotary_pass(ops.qkv_rotary_fused, qkv, b, cos, sin, heads, kv, grads)
    ref = _qkv_rotary_pass(ops.qkv_rotary_reference, qkv, b, cos, sin, heads, kv, grads)
    for name, a, r in zip(("q", "k", "v", "dqkv", "dbias"), fused, ref):
        assert a.shape == r.shape, name
        np.testing.assert_array_equal(a, r, err_msg=name)


def test_qkv_rotary_checks_its_inputs(rng):
    qkv = t(rng.standard_normal((2, 3, 8 * 16)))
    cos, sin = ops.rotary_tables(paddle.to_tensor(rng.integers(0, 9, (1, 3))), _inv_freq(16))
    with pytest.raises(Exception, match="not a multiple of H \\+ 2 KV"):
        ops.qkv_rotary_fused(qkv, None, cos, sin, 3, 1)
    with pytest.raises(Exception, match="bias must have the qkv width's 128 elements"):
        ops.qkv_rotary_fused(qkv, t(np.ones(100)), cos, sin, 4, 2)
    short = ops.rotary_tables(paddle.to_tensor(rng.integers(0, 9, (1, 2))), _inv_freq(16))
    with pytest.raises(Exception, match="cos/sin must be"):
        ops.qkv_rotary_fused(qkv, None, *short, 4, 2)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("batch,length,slot", [(4, 1, 7), (1, 1, 0), (2, 3, 5), (40, 1, 2)])   # 40 rows: split
@pytest.mark.parametrize("runs", [False, True])
def test_rotary_qkv_cache_write(rng, qk_norm, batch, length, slot, runs):
    """`runs`: neighbouring rows at one position in runs of 1-4 (a decode step's samples of a prompt), which take
    the first row's sines and cosines, the position changing between runs."""
    heads, kv, d, capacity = 4, 2, 32, 12
    qkv = t(rng.standard_normal((batch, length, (heads + 2 * kv) * d)))
    positions = rng.integers(0, 3000, (batch, length))
    if runs:
        positions = np.repeat(rng.permutation(3000)[:batch * length], rng.integers(1, 5, batch * length))
        positions = positions[:batch * length].reshape(batch, length)
    positions = paddle.to_tensor(positions)
    norms = (t(rng.standard_normal(d)), t(rng.standard_normal(d))) if qk_norm else (None, None)
    cache = [t(rng.standard_normal((batch, kv, capacity, d))) for _ in range(2)]
    fused_cache = [c.clone() for c in cache]
    q_fused = ops.rotary_qkv_cache_fused(qkv, positions, _inv_freq(d), *fused_cache, heads, kv, slot, *norms)
    q_ref = ops.rotary_qkv_cache_reference(qkv, positions, _inv_freq(d), *cache, heads, kv, slot, *norms)
    close(q_fused.numpy(), q_ref.numpy(), what="q")
    close(fused_cache[0].numpy(), cache[0].numpy(), what="k cache")
    np.testing.assert_array_equal(fused_cache[1].numpy(), cache[1].numpy())


# ------------------------------------------------------------------------------------------------ KV-cache relayout

def _kv_buffers(rng, rd, rs, heads, cd, cs, d):
    """dst and src: distinct random buffers (the window's old dst values differ from what is copied in)."""
    return t(rng.standard_normal((rd, heads, cd, d))), t(rng.standard_normal((rs, heads, cs, d)))


def _window(rng, n, rd, cd, cs, width, rows):
    return (paddle.to_tensor(np.asarray(rows, dtype=np.int64)), int(rng.integers(0, rd - n + 1)),
            int(rng.integers(0, cs - width + 1)), int(rng.integers(0, cd - width + 1)), width)


# n rows (None: a random subset, "fan": one row repeated n times), width; the last case is large enough for the
# (row, head) windows to be split across threads
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rd,rs,heads,cd,cs,d,n,width,rows", [
    (5, 4, 2, 12, 9, 8, 3, 6, None), (6, 6, 3, 7, 7, 16, 6, 7, None), (4, 3, 2, 10, 6, 8, 0, 4, None),
    (4, 3, 2, 10, 6, 8, 2, 0, None), (8, 2, 2, 9, 5, 32, 8, 5, "fan"), (3, 3, 1, 4, 20, 4, 1, 1, None),
    (24, 6, 4, 300, 260, 64, 24, 250, "fan")])
def test_kv_place_equals_reference(rng, dtype, rd, rs, heads, cd, cs, d, n, width, rows):
    if rows is None:
        rows = rng.permutation(rs)[:n]
    elif rows == "fan":  # one prompt fanned out to n samples
        rows = np.full(n, rng.integers(0, rs))
    dst32, src32 = _kv_buffers(rng, rd, rs, heads, cd, cs, d)
    args = _window(rng, n, rd, cd, cs, width, rows)
    # a copy is exact in any dtype: the float32 reference, cast (Paddle's CPU gather has no float16)
    expected = ops.kv_place_reference(dst32.clone(), src32, *args).astype(dtype)
    dst, src = dst32.astype(dtype), src32.astype(dtype)
    before = dst.clone()
    assert ops.kv_place_fused(dst, src, *args) is dst  # in place on the caller's tensor
    np.testing.assert_array_equal(dst.astype("float32").numpy(), expected.astype("float32").numpy())
    changed = (dst.astype("float32").numpy() != before.astype("float32").numpy()).any(axis=(1, 3))
    assert changed.sum() == len(rows) * width  # [row, slot] windows written
    # the dispatch takes the kernel and writes the same
    again = before.clone()
    assert kv_cache._fusable(again, src, args[0])
    assert ops.kv_place(again, src, *args) is again
    np.testing.assert_array_equal(again.astype("float32").numpy(), expected.astype("float32").numpy())


def test_kv_place_src_view_and_same_buffer(rng):
    """A strided src is read through a contiguous copy; dst and src in one buffer (overlapping windows) go to
    the reference, which copies the window before writing."""
    dst, src = _kv_buffers(rng, 4, 6, 2, 10, 12, 8)
    view = src[:, :, 2:11]  # not contiguous
    rows = paddle.to_tensor(np.array([5, 1, 1], dtype=np.int64))
    expected = ops.kv_place_reference(dst.clone(), view.contiguous(), rows, 1, 1, 3, 7)
    np.testing.assert_array_equal(ops.kv_place(dst, view, rows, 1, 1, 3, 7).numpy(), expected.numpy())
    buf = src.clone()
    keep = paddle.to_tensor(np.array([2, 3, 5], dtype=np.int64))  # compaction of one buffer into itself
    expected = ops.kv_place_reference(buf.clone(), src.clone(), keep, 0, 4, 0, 8)
    np.testing.assert_array_equal(ops.kv_place(buf, buf, keep, 0, 4, 0, 8).numpy(), expected.numpy())
    with pytest.raises(Exception, match="overlap"):
        ops.kv_place_fused(buf, buf, keep, 0, 4, 0, 8)
    with pytest.raises(Exception, match=r"src_rows\[1\] = 6 outside \[0, 6\)"):
        ops.kv_place_fused(dst, src, paddle.to_tensor(np.array([0, 6], dtype=np.int64)), 0, 0, 0, 2)


@pytest.mark.parametrize("dst_row,src_start,dst_start,width,n", [
    (3, 0, 0, 2, 2), (-1, 0, 0, 2, 1), (0, 5, 0, 2, 1), (0, -1, 0, 2, 1), (0, 0, 8, 3, 1), (0, 0, -2, 1, 1),
    (0, 0, 0, -1, 1), (0, 0, 0, 7, 1)])
def test_kv_place_out_of_bounds(rng, dst_row, src_start, dst_start, width, n):
    dst, src = _kv_buffers(rng, 4, 3, 2, 10, 6, 8)
    before = dst.numpy().copy()
    with pytest.raises(ValueError, match="kv_place: .* out of bounds"):
        ops.kv_place(dst, src, paddle.zeros([n], dtype="int64"), dst_row, src_start, dst_start, width)
    np.testing.assert_array_equal(dst.numpy(), before)


# ------------------------------------------------------------------------------------------------ attention

@pytest.mark.parametrize("batch,heads,kv,length", [(5, 4, 2, 9), (1, 2, 2, 1), (3, 8, 1, 16), (16, 4, 2, 100)])
def test_decode_attention(rng, batch, heads, kv, length):
    d, capacity = 32, max(20, length + 3)
    q = t(rng.standard_normal((batch, 1, heads, d)))
    k, v = (t(rng.standard_normal((batch, kv, capacity, d))) for _ in range(2))
    start = paddle.to_tensor(rng.integers(0, length, batch))
    args = (q, k, v, start, length, 1.0 / np.sqrt(d))
    close(ops.decode_attention_fused(*args).numpy(), ops.decode_attention_reference(*args).numpy(), what="attention")


@pytest.mark.parametrize("heads,kv,d,length", [(9, 3, 64, 37), (8, 2, 64, 50), (8, 2, 128, 40), (4, 1, 128, 600),
                                               (14, 2, 64, 21)])
def test_decode_attention_value_paths(rng, heads, kv, d, length):
    """Each way the kernel sums a window's values and scores its keys: whole rows in registers (head_dim 64,
    groups of up to 3), column tiles (groups of 4, or head_dim 128, windows that fit in L2), the per-slot sweep
    (a 128-dim window of 600 slots), blocks of 8 and 4 keys with the remainder one by one, head blocks 4 + 3."""
    batch, capacity = 3, length + 5
    q = t(rng.standard_normal((batch, 1, heads, d)))
    k, v = (t(rng.standard_normal((batch, kv, capacity, d))) for _ in range(2))
    start = paddle.to_tensor(rng.integers(0, length // 2, batch))
    args = (q, k, v, start, length, 1.0 / np.sqrt(d))
    close(ops.decode_attention_fused(*args).numpy(), ops.decode_attention_reference(*args).numpy(), what="attention")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (7, 1, 16), (12, 2, 12), (4, 4, 32)])
def test_decode_attention_on_a_16_bit_cache(rng, dtype, heads, kv, d):
    """A 16-bit cache (kv_cache_dtype) read as float32: the kernel equals the reference on the same rounded
    cache, for head blocks of 1-4 query heads (groups 3, 7, 6, 1) and a head_dim that is not a multiple of 8; and
    differs from attention over the unrounded keys (the cache really is 16-bit)."""
    batch, length, capacity = 6, 37, 45
    q = t(rng.standard_normal((batch, 1, heads, d)))
    k32, v32 = (t(rng.standard_normal((batch, kv, capacity, d)) * 2) for _ in range(2))
    k, v = k32.astype(dtype), v32.astype(dtype)
    start = paddle.to_tensor(rng.integers(0, length, batch))
    args = (q, k, v, start, length, 1.0 / np.sqrt(d))
    fused = ops.decode_attention_fused(*args).numpy()
    close(fused, ops.decode_attention_reference(*args).numpy(), what=f"attention ({dtype} cache)")
    full = ops.decode_attention_fused(q, k32, v32, start, length, 1.0 / np.sqrt(d)).numpy()
    assert 1e-5 < np.abs(fused - full).max() < 5e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rotary_qkv_cache_writes_a_16_bit_cache(rng, dtype):
    """The decode step's cache write rounds to the cache's dtype exactly as Paddle's cast does."""
    batch, heads, kv, d, capacity, slot = 3, 6, 2, 64, 10, 4
    qkv = t(rng.standard_normal((batch, 1, (heads + 2 * kv) * d)) * 3)
    positions = paddle.to_tensor(rng.integers(0, 3000, (batch, 1)))
    cache = [t(rng.standard_normal((batch, kv, capacity, d))).astype(dtype) for _ in range(2)]
    fused_cache = [c.clone() for c in cache]
    q_fused = ops.rotary_qkv_cache_fused(qkv, positions, _inv_freq(d), *fused_cache, heads, kv, slot)
    q_ref = ops.rotary_qkv_cache_reference(qkv, positions, _inv_freq(d), *cache, heads, kv, slot)
    close(q_fused.numpy(), q_ref.numpy(), what="q")
    assert fused_cache[0].dtype == getattr(paddle, dtype)
    as_float = [c.astype("float32").numpy() for c in (*fused_cache, *cache)]
    np.testing.assert_array_equal(as_float[1], as_float[3])    # values: the same rounding as astype
    # keys: rotated in float32 by both (to 1 ulp), then rounded: at most one 16-bit step apart
    step = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    assert np.all(np.abs(as_float[0] - as_float[2]) <= step * np.maximum(np.abs(as_float[2]), 1e-3))


@pytest.mark.parametrize("batch,kv,groups,length,keys,bias_batch", [(3, 2, 2, 5, 9, 3), (2, 1, 4, 1, 7, 2),
                                                                     (1, 2, 1, 6, 6, 1), (16, 2, 2, 63, 99, 16)])
def test_masked_softmax_and_gradient(rng, batch, kv, groups, length, keys, bias_batch):
    """softmax(scale * scores + bias) with a padding + causal bias shared by the heads; rows whose keys are all
    masked (left padding) stay finite, as in the reference."""
    mask = np.ones((bias_batch, keys), np.int64)
    mask[0, :3] = 0                                     # left padding on the first row
    bias = attention_bias_from_mask(paddle.to_tensor(mask), length, causal=True)
    scores = t(rng.standard_normal((batch, kv, groups * length, keys)) * 3, grad=True)
    out = ops.masked_softmax_fused(scores, bias, 0.125)
    ref = ops.masked_softmax_reference(scores, bias, 0.125)
    close(out.numpy(), ref.numpy(), what="probs")
    assert np.isfinite(out.numpy()).all()
    g = t(rng.standard_normal(out.shape))
    grad, = paddle.grad((out * g).sum(), [scores])
    ref_grad, = paddle.grad((ref * g).sum(), [scores])
    close(grad.numpy(), ref_grad.numpy(), what="d scores")
    assert ops.masked_softmax(scores, bias, 0.125).shape == out.shape


def packing_spans(rng, groups_of, width=24, longest_prompt=19, shortest_prompt=1, shortest_response=0):
    """A models.packing.Packing for prompts of random lengths with `groups_of[u]` responses each (some empty
    unless shortest_response > 0)."""
    prompts = [list(rng.integers(0, 50, int(rng.integers(shortest_prompt, longest_prompt + 1)))) for _ in groups_of]
    rows = np.repeat(np.arange(len(groups_of)), groups_of)
    lengths = rng.integers(shortest_response, width + 1, len(rows))
    return Packing(prompts, rows, rng.integers(0, 50, (len(rows), width)), lengths)


@pytest.mark.parametrize("groups_of,heads,kv,d,width", [([3, 1, 2], 6, 2, 32, 24), ([8], 9, 3, 64, 24),
                                                        ([1, 1], 4, 4, 16, 24), ([2, 4, 1, 3], 8, 1, 128, 24),
                                                        ([14, 6, 2], 4, 2, 32, 90)])
def test_packed_attention_and_gradients(rng, groups_of, heads, kv, d, width):
    """The packed row's attention (prompts causal, each response on its prompt and causally on itself) against
    the dense masked reference, with q, k and v's gradients; every key's readers are the range its spans name. The
    last case has keys read by over 512 and over 192 queries (the backward's wider key blocks) whatever the seed:
    its prompts of 120-150 tokens and responses of 40-90 give the 14-response prompt's first key >= 680 readers
    and the 2-response prompt's first key 200-330."""
    wide = width > 24
    packing = packing_spans(rng, groups_of, width, longest_prompt=150 if wide else 19,
                            shortest_prompt=120 if wide else 1, shortest_response=40 if wide else 0)
    n, spans = packing.tokens, packing.spans
    mask = ops.packed_key_mask(spans).numpy()
    query_end = spans.numpy()[:, 3]
    for j in range(n):  # the kernel's contract: key j is read by the queries [j, query_end[j]) and no other
        assert np.array_equal(np.flatnonzero(mask[:, j]), np.arange(j, query_end[j])), j
    readers = query_end - np.arange(n)
    if wide:
        assert readers.max() >= 512 and ((readers >= 192) & (readers < 512)).any()
    q = t(rng.standard_normal((n, heads, d)), grad=True)
    k, v = t(rng.standard_normal((n, kv, d)), grad=True), t(rng.standard_normal((n, kv, d)), grad=True)
    out = ops.packed_attention_fused(q, k, v, spans, d ** -0.5)
    ref = ops.packed_attention_reference(q, k, v, spans, d ** -0.5)
    close(out.numpy(), ref.numpy(), what="out")
    g = t(rng.standard_normal(out.shape))
    grads = paddle.grad((out * g).sum(), [q, k, v])
    ref_grads = paddle.grad((ref * g).sum(), [q, k, v])
    for name, a, b in zip("qkv", grads, ref_grads):
        close(a.numpy(), b.numpy(), what=f"d {name}")


def test_packed_attention_bits_do_not_depend_on_threads(tmp_path):
    """Each output and gradient row is one thread's sum in a fixed order: 1 and 2 threads give the same bits
    (DP with one thread per process equals one process with two)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, numpy as np, paddle\n"
        "from paddle_rl import ops\n"
        "from paddle_rl.models.packing import Packing\n"
        "ops.configure('on')\n"
        "rng = np.random.default_rng(3)\n"
        "rows = np.repeat(np.arange(3), [4, 2, 5])\n"
        "p = Packing([list(rng.integers(0, 9, m)) for m in (21, 5, 40)], rows, rng.integers(0, 9, (11, 70)),\n"
        "            rng.integers(0, 71, 11))\n"
        "n = p.tokens\n"
        "x = [paddle.to_tensor(rng.standard_normal(s).astype('float32'), stop_gradient=False)\n"
        "     for s in ((n, 6, 64), (n, 2, 64), (n, 2, 64))]\n"
        "out = ops.packed_attention_fused(*x, p.spans, 0.125)\n"
        "grads = paddle.grad((out * out).sum(), x)\n"
        "np.savez(sys.argv[1], out=out.numpy(), *[g.numpy() for g in grads])\n")
    results = []
    for threads in ("1", "2"):
        env = dict(os.environ, PADDLE_RL_OP_THREADS=threads, OMP_NUM_THREADS=threads,
                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        target = tmp_path / f"t{threads}.npz"
        subprocess.run([sys.executable, str(script), str(target)], env=env, check=True, capture_output=True)
        results.append(np.load(target))
    for name in results[0].files:
        assert np.array_equal(results[0][name], results[1][name]), name


# ------------------------------------------------------------------------------------------------ sampling

SETTINGS = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.7),
    "temperature_near_0": dict(temperature=1e-5),
    "greedy": dict(temperature=0.0),
    "greedy_penalty": dict(temperature=0.0, penalty=1.3),
    "top_k_1": dict(top_k=1),
    "top_k": dict(top_k=40, temperature=1.2),
    "top_p_1": dict(top_p=1.0),
    "top_p": dict(top_p=0.6),
    "top_p_tiny": dict(top_p=0.01),
    "everything": dict(temperature=0.9, top_k=200, top_p=0.8, penalty=1.2),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("batch,vocab", [(64, 4096), (1, 97)])
def test_sample_equals_reference(rng, setting, batch, vocab):
    logits = t(rng.standard_normal((batch, vocab)) * rng.uniform(0.5, 4.0))
    seen = t(rng.random((batch, vocab)) < 0.05)
    ban = paddle.to_tensor(rng.random(batch) < 0.5)
    args = dict(uniforms=t(rng.random(batch)), seen=seen, ban_rows=ban, stop_ids=[1, 5], **SETTINGS[setting])
    tokens, logp = ops.sample_fused(logits, **args)
    ref_tokens, ref_logp = ops.sample_reference(logits, **args)
    assert tokens.numpy().tolist() == ref_tokens.numpy().tolist(), f"seed {SEED}"
    # a near-zero temperature scales the logits' float32 rounding by 1 / T: where two logits of a row nearly tie
    # (gap ~ T) the sampled log-prob moves by up to a few ulps of the logits over T (seen: 6e-3 at T 1e-5)
    temperature = SETTINGS[setting].get("temperature", 1.0)
    rel = 2e-5 if temperature == 0 or temperature >= 1e-3 else max(
        2e-5, 4 * 2.0 ** -24 * float(np.abs(logits.numpy()).max()) / temperature)
    close(logp.numpy(), ref_logp.numpy(), rel=rel, what="sampled logprob")
    if SETTINGS[setting].get("top_k") == 1:
        processed = ops.sampling.ban_tokens(ops.sampling.apply_repetition_penalty(logits, seen, 1.0), [1, 5], ban)
        assert tokens.numpy().tolist() == paddle.argmax(processed, -1).numpy().tolist()


def test_sample_every_token_banned_but_stop_token(rng):
    batch, vocab, eos = 16, 300, 7
    logits = np.full((batch, vocab), -1e9, dtype=np.float32)
    logits[:, eos] = 2.0
    u = t(rng.random(batch))
    for ban_rows in (None, paddle.to_tensor(np.arange(batch) % 2 == 0)):
        args = dict(uniforms=u, ban_rows=ban_rows, stop_ids=[eos], temperature=0.8, top_p=0.9, top_k=5)
        tokens, logp = ops.sample_fused(t(logits), **args)
        ref_tokens, ref_logp = ops.sample_reference(t(logits), **args)
        assert tokens.numpy().tolist() == ref_tokens.numpy().tolist()
        close(logp.numpy(), ref_logp.numpy(), rel=2e-5, what="logprob")
        if ban_rows is None:
            assert (tokens.numpy() == eos).all()
        else:   # a banned row has every logit at -1e9: every token is equally likely, the stop token included
            assert (tokens.numpy()[1::2] == eos).all()


def test_sample_dispatch_follows_mode(rng):
    logits, u = t(rng.standard_normal((4, 50))), t(rng.random(4))
    fused = ops.sample(logits, u, temperature=0.8, top_p=0.7)
    ops.configure("off")
    try:
        ref = ops.sample(logits, u, temperature=0.8, top_p=0.7)
    finally:
        ops.configure("on")
    assert fused[0].numpy().tolist() == ref[0].numpy().tolist()


# ------------------------------------------------------------------------------------------------ rollout state

@pytest.mark.parametrize("with_seen", [False, True])
@pytest.mark.parametrize("batch", [1, 33])
def test_step_update(rng, with_seen, batch):
    vocab = 40
    tokens = paddle.to_tensor(rng.integers(0, 12, batch))
    logprob = t(rng.standard_normal(batch))
    finished = paddle.to_tensor(rng.random(batch) < 0.3)
    lengths = paddle.to_tensor(rng.integers(0, 6, batch))
    stop = paddle.to_tensor(np.array([3, 8], dtype=np.int64))
    seen = t(rng.random((batch, vocab)) < 0.2) if with_seen else None
    fused_seen = None if seen is None else seen.clone()
    fused = ops.step_update_fused(tokens, logprob, finished, lengths, stop, fused_seen, 0, 4)
    ref = ops.step_update_reference(tokens, logprob, finished, lengths, stop, seen, 0, 4)
    for name in ("tokens", "logprob", "finished", "lengths", "ban", "done"):
        np.testing.assert_array_equal(getattr(fused, name).numpy(), getattr(ref, name).numpy(), err_msg=name)
    if with_seen:
        np.testing.assert_array_equal(fused.seen.numpy(), ref.seen.numpy())
    empty = paddle.to_tensor(np.zeros([0], dtype=np.int64))
    fused = ops.step_update_fused(tokens, logprob, finished, lengths, empty, None, 0, 0)
    assert not fused.finished.numpy()[~finished.numpy()].any() and not fused.ban.numpy().any()


# ------------------------------------------------------------------------------------------------ LM-head log-probs

@pytest.mark.parametrize("keep_logits", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows,chunk,tied,temperature,vocab", [(37, 8, False, 0.7, 301), (1, None, False, 1.0, 301),
                                                               (20, 20, True, 0.0, 301), (50, 7, True, 1.3, 301),
                                                               (300, None, False, 1.0, 1024)])
def test_lm_head_logprobs_and_gradients(rng, monkeypatch, keep_logits, fused, rows, chunk, tied, temperature, vocab):
    if not keep_logits:   # the backward recomputes each chunk's logits
        monkeypatch.setattr(logprob_module, "SAVE_LOGITS_BYTES", 0)
    hidden_size = 24
    hidden = t(rng.standard_normal((rows, hidden_size)), grad=True)
    shape = (vocab, hidden_size) if tied else (hidden_size, vocab)
    weight = t(rng.standard_normal(shape) * 0.4, grad=True)
    labels = paddle.to_tensor(rng.integers(0, vocab, rows))
    a, b = t(rng.standard_normal(rows)), t(rng.standard_normal(rows))
    logp, entropy = ops.lm_head_logprobs(hidden, weight, labels, temperature, True, transpose_weight=tied,
                                         chunk_rows=chunk, fused=fused)
    ref_logp, ref_entropy = ops.lm_head_logprobs_reference(hidden, weight, labels, temperature, True,
                                                           transpose_weight=tied)
    close(logp.numpy(), ref_logp.numpy(), rel=2e-5, what="logp")
    close(entropy.numpy(), ref_entropy.numpy(), rel=2e-5, what="entropy")
    grads = paddle.grad((logp * a).sum() + (entropy * b).sum(), [hidden, weight])
    ref_grads = paddle.grad((ref_logp * a).sum() + (ref_entropy * b).sum(), [hidden, weight])
    for g, r, name in zip(grads, ref_grads, ("d hidden", "d weight")):
        close(g.numpy(), r.numpy(), rel=1e-4, what=name)
    with paddle.no_grad():
        nograd, _ = ops.lm_head_logprobs(hidden, weight, labels, temperature, transpose_weight=tied, chunk_rows=chunk,
                                         fused=fused)
    close(nograd.numpy(), ref_logp.numpy(), rel=2e-5, what="no-grad logp")


def test_lm_head_logprob_gradient_of_logp_only(rng):
    hidden = t(rng.standard_normal((9, 16)), grad=True)
    weight = t(rng.standard_normal((16, 50)), grad=True)
    labels = paddle.to_tensor(rng.integers(0, 50, 9))
    logp, entropy = ops.lm_head_logprobs(hidden, weight, labels, 1.0, with_entropy=False, fused=True)
    assert entropy is None
    ref, _ = ops.lm_head_logprobs_reference(hidden, weight, labels, 1.0)
    for g, r in zip(paddle.grad(logp.sum(), [hidden, weight]), paddle.grad(ref.sum(), [hidden, weight])):
        close(g.numpy(), r.numpy(), rel=1e-4, what="grad")


def test_row_argmax_is_paddles_argmax(rng):
    """The CPU kernel's argmax of each row equals paddle.argmax: the first index of a tie, -inf entries, rows
    wider than a vector and a row whose largest value is last."""
    logits = rng.standard_normal((37, 4099)).astype(np.float32)
    logits[1] = 0.0                                   # an all-way tie: 0
    logits[2, [5, 900, 4000]] = 9.0                   # a 3-way tie: 5
    logits[3, :] = -np.inf
    logits[3, 77] = -1.0
    logits[4, -1] = 50.0                              # the last column
    logits = np.round(logits, 1)                      # many ties
    x = t(logits)
    got = logprob_module.row_argmax(x).numpy()
    np.testing.assert_array_equal(got, paddle.argmax(x, axis=-1).numpy())
    assert got[1] == 0 and got[2] == 5 and got[3] == 77 and got[4] == 4098


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_greedy_is_the_argmax_of_each_row(rng, fused, tied):
    """with_greedy: the argmax of each row's logits, chunk by chunk (4 chunks of 5 rows here), equal to NumPy's
    (first index of a tie); the log-probs unchanged; a pass with gradients gives the same and still back-propagates."""
    hidden = t(rng.standard_normal((20, 12)))
    weight = t(rng.standard_normal((40, 12) if tied else (12, 40)))
    hidden[3] = 0.0   # every logit 0: a 40-way tie, argmax 0
    labels = paddle.to_tensor(rng.integers(0, 40, 20))
    with paddle.no_grad():
        logp, _, greedy = ops.lm_head_logprobs(hidden, weight, labels, 0.7, transpose_weight=tied, chunk_rows=5,
                                               fused=fused, with_greedy=True)
        plain, _ = ops.lm_head_logprobs(hidden, weight, labels, 0.7, transpose_weight=tied, chunk_rows=5, fused=fused)
    logits = hidden.numpy() @ (weight.numpy().T if tied else weight.numpy())
    np.testing.assert_array_equal(greedy.numpy(), logits.argmax(-1))
    assert greedy.numpy()[3] == 0
    np.testing.assert_array_equal(logp.numpy(), plain.numpy())
    # a pass with gradients (the update's forward, old_logprob_pass auto) gives the same argmax and log-probs
    hidden.stop_gradient = False
    logp_g, _, greedy_g = ops.lm_head_logprobs(hidden, weight, labels, 0.7, transpose_weight=tied, chunk_rows=5,
                                               fused=fused, with_greedy=True)
    np.testing.assert_array_equal(greedy_g.numpy(), greedy.numpy())
    np.testing.assert_allclose(logp_g.numpy(), logp.numpy(), rtol=1e-6, atol=1e-6)
    logp_g.sum().backward()
    assert hidden.grad is not None and np.abs(hidden.grad.numpy()).max() > 0


# ------------------------------------------------------------------------------------------------ modes and cache

def test_every_kernel_source_is_built_and_registers_its_ops():
    """Each csrc/cpu/*.cc is #included by exactly one of the translation units the build compiles
    (build.CPU_UNITS), and the built library registers every op those sources declare (PD_BUILD_OP): a source
    left out of the units, or one included twice, fails here."""
    included = {}
    for unit in build.CPU_UNITS:
        with open(os.path.join(build.CSRC, unit), encoding="utf-8") as f:
            for name in re.findall(r'^#include "cpu/(\w+\.cc)"', f.read(), flags=re.M):
                included[name] = included.get(name, 0) + 1
    sources = sorted(n for n in os.listdir(os.path.join(build.CSRC, "cpu")) if n.endswith(".cc"))
    assert {n: included.get(n, 0) for n in sources} == {n: 1 for n in sources}
    declared = set()
    for name in sources:
        with open(os.path.join(build.CSRC, "cpu", name), encoding="utf-8") as f:
            declared |= set(re.findall(r"^PD_BUILD_OP\((\w+)\)", f.read(), flags=re.M))
    assert len(declared) >= 25, declared
    assert ops.available()
    # registered in a new process: this one registered the library when the first test loaded it
    code = ("import json, sys; from paddle_rl.ops import build; "
            "print(json.dumps(build._register(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", code, build.status()["library"]], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-2000:]
    registered = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert registered == declared


def test_modes(monkeypatch, caplog):
    assert ops.available() and build.status()["loaded"]
    assert os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(build.status()["library"])), "built.json"))
    with pytest.raises(ValueError, match="use_custom_ops"):
        ops.configure("sometimes")
    try:
        ops.configure("off")
        assert not ops.available()
        ones = np.ones((2, 8))
        assert np.allclose(ops.rms_norm(t(ones), t(np.ones(8)), 1e-6).numpy(), ones)
        # a build that fails: auto falls back with one log line, on raises
        monkeypatch.setattr(build, "build", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no compiler")))
        ops.configure("auto")
        with caplog.at_level(logging.WARNING, logger="paddle_rl"):
            assert not ops.available() and not ops.available()
        assert sum("custom ops unavailable" in r.getMessage() for r in caplog.records) == 1
        assert "no compiler" in build.status()["reason"]
        with pytest.raises(ops.CustomOpsError, match="no compiler"):
            ops.configure("on")
    finally:
        monkeypatch.undo()
        build._State.loaded = None
        ops.configure("on")
    assert ops.available()


def test_a_run_loads_the_kernels_in_its_setup(tmp_path, monkeypatch):
    """A run builds and loads the fused kernels while it sets up (StepLoop), in auto mode too, not at their first
    call inside step 1's rollout, whose time a build (~1.5 min on 2 cores after a source change) would count."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    monkeypatch.setattr(build._State, "loaded", None)   # as in a new process: nothing loaded yet
    config = load_config("configs/tiny_arith_grpo.yaml", {"output_dir": str(tmp_path / "out"),
                                                           "logging_dir": str(tmp_path / "logs")})
    assert config.use_custom_ops == "auto"
    StepLoop(config)
    assert build._State.loaded is True and build.mode() == "auto"
    ops.configure("on")


# ------------------------------------------------------------------------------------------------ in the model

def _training_decoder(seed: int, vocab: int, layers: int):
    """A small qwen3-shaped decoder (hidden 32, GQA 4 / 2 heads) at random init, in training mode."""
    paddle.seed(seed)
    model = CausalLM(ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))
    model.init_weights(0.2)
    model.train()
    return model


def test_model_gradients_with_kernels_and_recompute(rng, monkeypatch):
    """A decoder's log-prob gradients are the same with the fused kernels or the references, and with each
    recompute_granularity (paddle.distributed.fleet.utils.recompute on CPU): full reruns every layer in the
    backward, full_attn every self-attention block, core_attn every attention core (softmax(QK^T)V) and nothing
    else, core_attn_mlp every attention core and the MLP block up to its down projection (whose gradients are
    taken without its forward)."""
    model = _training_decoder(seed=1, vocab=120, layers=2)
    cfg = model.config
    ids = paddle.to_tensor(rng.integers(0, 120, (3, 10)))
    mask = paddle.to_tensor(np.array([[1] * 10, [0] * 3 + [1] * 7, [0] + [1] * 9]))
    # calls of each part, counted apart in the forward pass and in the backward
    parts = {"layer": (DecoderLayer, "forward"), "attention": (Attention, "forward"), "core": (Attention, "_core"),
             "mlp": (MLP, "forward"), "mlp_inner": (MLP, "inner")}
    calls = {}
    phase = ["forward"]

    def counter(name, fn):
        def counted(self, *args, **kwargs):
            calls[name, phase[0]] = calls.get((name, phase[0]), 0) + 1
            return fn(self, *args, **kwargs)
        return counted

    grads, counts = {}, {}
    with monkeypatch.context() as m:
        for name, (cls, attr) in parts.items():
            m.setattr(cls, attr, counter(name, getattr(cls, attr)))
        for mode, recompute in (("on", None), ("off", None), ("on", "full"), ("off", "full"), ("on", "full_attn"),
                                ("on", "core_attn"), ("off", "core_attn"), ("on", "core_attn_mlp")):
            ops.configure(mode)
            model.recompute = recompute
            calls.clear()
            phase[0] = "forward"
            logp, entropy = token_logprobs(model, ids, mask, 4, ids[:, 4:], 0.9, with_entropy=True)
            phase[0] = "backward"
            (logp.sum() - 0.1 * entropy.sum()).backward()
            counts[mode, recompute] = {name: calls.get((name, "backward"), 0) for name in parts}
            assert all(calls.get((name, "forward"), 0) == cfg.num_hidden_layers for name in parts), calls
            grads[mode, recompute] = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
            model.clear_gradients()
    ops.configure("on")
    model.recompute = None
    n = cfg.num_hidden_layers
    # without recompute the backward reuses the saved activations; with it the recomputed part runs again
    rerun = {None: (0, 0, 0, 0, 0), "full": (n, n, n, n, n), "full_attn": (0, n, n, 0, 0),
             "core_attn": (0, 0, n, 0, 0), "core_attn_mlp": (0, 0, n, 0, n)}
    for (mode, recompute), got in counts.items():
        assert tuple(got[name] for name in parts) == rerun[recompute], (mode, recompute, got)
    for key in grads:
        for name, ref in grads["on", None].items():
            close(grads[key][name], ref, rel=1e-4, what=f"{key} {name}")


@pytest.mark.parametrize("bf16", [False, True])
def test_mlp_recompute_takes_the_down_projections_gradients_without_its_forward(rng, monkeypatch, bf16):
    """core_attn_mlp keeps each MLP block's input only; its backward makes the down projection's input again and
    takes that projection's gradients from it (ops.product_gradients) without running its forward: the gradients of
    every parameter are those of core_attn (the block's activations kept), bit for bit, in float32 and with bf16
    products, and of Paddle's recompute of the whole block; the down projection's forward runs once per layer
    (Paddle's recompute: twice). With the stand-in's backward perturbed the gradients differ."""
    model = _training_decoder(seed=4, vocab=100, layers=3)
    if bf16:
        model.set_bf16(True, True)
    ids = paddle.to_tensor(rng.integers(0, 100, (3, 11)))
    mask = paddle.to_tensor(np.array([[1] * 11, [0] * 3 + [1] * 8, [0] + [1] * 10]))
    downs = []
    forward = RowLinear.forward
    monkeypatch.setattr(RowLinear, "forward",
                        lambda self, *a, **k: downs.append(self.module_names[0]) or forward(self, *a, **k))

    def grads(recompute):
        model.recompute = recompute
        downs.clear()
        logp, entropy = token_logprobs(model, ids, mask, 4, ids[:, 4:], 0.9, with_entropy=True)
        (logp.sum() - 0.1 * entropy.sum()).backward()
        out = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        model.clear_gradients()
        model.recompute = None
        return out, sum("down_proj" in name for name in downs)

    kept, kept_downs = grads("core_attn")
    ours, our_downs = grads("core_attn_mlp")
    with monkeypatch.context() as m:
        m.setattr(_MlpRecompute, "applies", staticmethod(lambda *a: False))   # Paddle's recompute of the block
        paddle_rc, paddle_downs = grads("core_attn_mlp")
    layers = model.config.num_hidden_layers
    assert (kept_downs, our_downs, paddle_downs) == (layers, layers, 2 * layers)
    # what the bench counts as rerun: nothing here; Gemma's sandwich norms keep Paddle's whole-block recompute
    assert not mlp_recompute_reruns_down(model)
    gemma = CausalLM(ModelConfig(model_type="gemma3_text", vocab_size=50, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert mlp_recompute_reruns_down(gemma)
    assert kept.keys() == ours.keys() == paddle_rc.keys()
    for name, ref in kept.items():
        np.testing.assert_array_equal(ours[name], ref, err_msg=name)
        np.testing.assert_array_equal(paddle_rc[name], ref, err_msg=name)
    with monkeypatch.context() as m:
        backward = ops.linear._ProductGradients.backward
        m.setattr(ops.linear._ProductGradients, "backward",
                  staticmethod(lambda ctx, dy: backward(ctx, dy * 1.001)))
        perturbed, _ = grads("core_attn_mlp")
    changed = [n for n in kept if not np.array_equal(perturbed[n], kept[n])]
    assert any("down_proj" in n for n in changed) and any("gate_up" in n for n in changed), changed


@pytest.mark.parametrize("shape", [(3, 5, 2 * 48), (1, 1, 2 * 688), (7, 2), (4, 40, 2 * 1376)])
def test_swiglu_and_gradient(rng, shape):
    x = t(rng.standard_normal(shape) * 4, grad=True)
    fused, ref = ops.swiglu_fused(x), ops.swiglu_reference(x)
    close(fused.numpy(), ref.numpy(), what="swiglu")
    g = t(rng.standard_normal(ref.shape))
    close(paddle.grad(fused, x, g)[0].numpy(), paddle.grad(ref, x, g)[0].numpy(), what="swiglu dx")


# ------------------------------------------------------------------------------------------------ packed linear

@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (5, 64, 70), (13, 40, 33), (64, 96, 256), (7, 24, 1),
                                      (9, 1100, 40), (66, 576, 70), (2, 257, 48)])
def test_packed_linear(rng, rows, k, n):
    """x @ W from the packed copy: every row-tile size (6, 3 or fewer rows; half panels and whole ones, K past
    1024 in half panels too), a last panel cut short, and a row's result bit for bit the same alone (a 1-row tile of
    the whole panel) as in any batch (each row sums over k in order, whichever tile). Past K = 256 a panel's halves
    lie one after the other (the packing equals the reference's, which reads them so)."""
    x = t(rng.standard_normal((rows, k)))
    w = t(rng.standard_normal((k, n)))
    packed = ops.pack_weight_fused(w)
    assert packed.shape == [(n + 31) // 32, k, 32]
    np.testing.assert_array_equal(packed.numpy(), ops.pack_weight_reference(w).numpy())
    out = ops.packed_linear_fused(x, packed, n).numpy()
    close(out, paddle.matmul(x, w).numpy(), what="packed linear")
    close(ops.packed_linear_reference(x, packed, n).numpy(), paddle.matmul(x, w).numpy(), what="reference")
    for r in (0, rows - 1):
        np.testing.assert_array_equal(ops.packed_linear_fused(x[r:r + 1], packed, n).numpy(), out[r:r + 1])
    # a batch of [..., K] keeps its leading dims; a tied head packs the [N, K] table
    x3 = x.reshape([1, rows, k])
    assert ops.packed_linear_fused(x3, packed, n).shape == [1, rows, n]
    table = t(rng.standard_normal((n, k)))
    np.testing.assert_array_equal(ops.pack_weight_fused(table, transposed=True).numpy(),
                                  ops.pack_weight_reference(table, transposed=True).numpy())
    close(ops.packed_linear_fused(x, ops.pack_weight(table, transposed=True), n).numpy(),
          paddle.matmul(x, table, transpose_y=True).numpy(), what="packed tied head")


def test_packed_linear_checks_its_inputs(rng):
    x, w = t(rng.standard_normal((2, 16))), t(rng.standard_normal((16, 40)))
    packed = ops.pack_weight(w)
    with pytest.raises(Exception, match="prl_packed_linear: packed must be"):
        ops.packed_linear_fused(t(rng.standard_normal((2, 8))), packed, 40)
    with pytest.raises(Exception, match="prl_packed_linear: n 70 does not match 2 panels"):
        ops.packed_linear_fused(x, packed, 70)
    with pytest.raises(Exception, match="prl_packed_linear: packed must be float32"):
        ops.packed_linear_fused(x, packed.astype("bfloat16"), 40)


# ------------------------------------------------------------------------------------------------ low-precision packed linear

def bf16(a):
    """float32 rounded to bfloat16 (nearest even), as float32."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def lowp_numpy(x, w, fmt, bf16_act):
    """The kernel's arithmetic in NumPy float32, k in the kernel's order: bfloat16 pairs odd k then even k (as
    vdpbf16ps), int8 the integers summed and the column scale applied once, int4 the group-dequantized weights."""
    f32 = np.float32
    x = bf16(x) if bf16_act else x.astype(f32)
    k = w.shape[0]
    if fmt == "bfloat16":
        order = [kk + e for kk in range(0, k, 2) for e in (1, 0) if kk + e < k]
        wq, scale = bf16(w), None
    elif fmt == "weight_only_int8":
        scale = (np.abs(w).max(axis=0) / f32(127)).astype(f32)
        wq = np.clip(np.rint(w / np.where(scale > 0, scale, f32(1))), -127, 127).astype(f32)
        order = range(k)
    else:
        wq = np.empty_like(w)
        for g in range(0, k, 128):
            s = (np.abs(w[g:g + 128]).max(axis=0) / f32(7)).astype(f32)
            wq[g:g + 128] = np.clip(np.rint(w[g:g + 128] / np.where(s > 0, s, f32(1))), -7, 7).astype(f32) * s
        scale, order = None, range(k)
    acc = np.zeros((x.shape[0], w.shape[1]), f32)
    for i in order:
        acc = acc + x[:, i:i + 1] * wq[i]
    return acc if scale is None else acc * scale


LOWP_CASES = [("bfloat16", True), ("weight_only_int8", False), ("weight_only_int8", True),
              ("weight_only_int4", False), ("weight_only_int4", True)]


@pytest.mark.parametrize("fmt,bf16_act", LOWP_CASES)
@pytest.mark.parametrize("rows,k,n", [(1, 64, 40), (5, 200, 40), (13, 130, 64), (7, 301, 33), (50, 160, 70)])
def test_packed_linear_low_precision(rng, monkeypatch, fmt, bf16_act, rows, k, n):
    """rollout_dtype bfloat16 / rollout_quant_type: the kernel's packed bytes equal the pure-Paddle packing's, its
    products equal NumPy's of the same arithmetic (bit for bit where every product is exact in float32: bfloat16
    activations times bfloat16 or int8 weights; else to 2e-6 relative, the fused multiply-add's one rounding), the
    AVX-512 tiles equal the portable ones (PADDLE_RL_BF16_EMULATE, for bfloat16) bit for bit, and the result is not
    float32's. 50 rows: enough tiles that the bfloat16 ones fetch the next panel a line every 8 k steps."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    w[:, 3] = 0.0    # a zero column: scale 0, no division by it
    packed = ops.pack_weight_lowp_fused(t(w), False, fmt)
    ref_data, ref_scales = ops.pack_weight_lowp_reference(t(w), False, fmt)
    view = (lambda a: a.astype("float32").numpy()) if fmt == "bfloat16" else (lambda a: a.numpy())
    np.testing.assert_array_equal(view(packed[0]), view(ref_data))
    np.testing.assert_array_equal(packed[1].numpy(), ref_scales.numpy())
    p = ops.pack_weight_lowp(t(w), False, fmt, bf16_act)
    out = ops.packed_linear_lowp_fused(t(x), p).numpy()
    expected = lowp_numpy(x, w, fmt, bf16_act)
    # AMX tiles (bfloat16, and int8 weights widened to bfloat16): their own order of the sums
    amx = fmt != "weight_only_int4" and "amx" in ops.bf16_kernels()
    exact = bf16_act and fmt != "weight_only_int4"
    if exact and not amx:
        np.testing.assert_array_equal(out, expected)
    else:
        close(out, expected, rel=2e-6, what=fmt)
    close(ops.packed_linear_lowp_reference(t(x), p).numpy(), expected, rel=1e-5, what=f"{fmt} reference")
    monkeypatch.setenv("PADDLE_RL_BF16_EMULATE", "1")
    portable = ops.packed_linear_lowp_fused(t(x), p).numpy()
    monkeypatch.delenv("PADDLE_RL_BF16_EMULATE")
    if amx:  # the AVX-512 tiles of CPUs without AMX: NumPy's order (and bits where the products are exact)
        monkeypatch.setenv("PADDLE_RL_BF16_AMX", "0")
        avx512 = ops.packed_linear_lowp_fused(t(x), p).numpy()
        monkeypatch.delenv("PADDLE_RL_BF16_AMX")
        (np.testing.assert_array_equal if exact else functools.partial(close, rel=2e-6))(avx512, expected)
        np.testing.assert_array_equal(portable, avx512)   # the emulation leaves the tiles too
    else:
        np.testing.assert_array_equal(portable, out)
    # each row alone gives the same bits (batch invariance), and the rounding shows against float32
    np.testing.assert_array_equal(ops.packed_linear_lowp_fused(t(x[-1:]), p).numpy(), out[-1:])
    gap = np.abs(out - x @ w).max() / np.abs(x @ w).max()
    # (a loose upper bound: the exact checks are above; one row of int4 can sit a fifth of the row's largest value off)
    low, high = {"bfloat16": (2e-4, 0.05), "weight_only_int8": (5e-4, 0.1), "weight_only_int4": (5e-3, 0.5)}[fmt]
    assert low < gap < high, gap
    # the dispatch (packed_linear) takes a LowpPacked, and a tied head packs its [N, K] table
    np.testing.assert_array_equal(ops.packed_linear(t(x), p, n).numpy(), out)
    table = ops.pack_weight_lowp(t(np.ascontiguousarray(w.T)), True, fmt, bf16_act)
    np.testing.assert_array_equal(ops.packed_linear(t(x), table, n).numpy(), out)


@pytest.mark.parametrize("rows,k,n", [(1, 576, 40), (16, 576, 96), (40, 301, 70)])
def test_int8_amx_tiles(rng, monkeypatch, rows, k, n):
    """weight_only_int8 on AMX-BF16 tiles: float32 activations as three bfloat16 parts (x exactly: not rounded to
    bfloat16), bf16_act as one; int8 x bfloat16 products are exact, so against float64 the error is the float32
    sums' alone: within 4 u of s_j sum_k |x_k q_kj| (u = 2^-24; measured <= 0.8 u; two parts, 16 bits of x, miss
    it by far at this x's range of magnitudes). Each row alone, or in another batch, gives the batch's bits (one
    16-row block or three)."""
    if "amx" not in ops.bf16_kernels():
        pytest.skip("the CPU, OS or build has no AMX-BF16 tiles")
    x = (rng.standard_normal((rows, k)) * 2.0 ** rng.integers(-30, 30, (rows, k))).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    u = 2.0 ** -24
    for bf16_act in (False, True):
        p = ops.pack_weight_lowp(t(w), False, "weight_only_int8", bf16_act)
        q = p.data.numpy().astype(np.float64).transpose(1, 0, 2).reshape(k, -1)[:, :n]
        s = p.scales.numpy().astype(np.float64)[:n]
        xa = (bf16(x) if bf16_act else x).astype(np.float64)
        out = ops.packed_linear_lowp_fused(t(x), p).numpy()
        err = np.abs(out - xa @ q * s) / (np.abs(xa) @ np.abs(q) * s)
        assert err.max() <= 4 * u, (bf16_act, err.max() / u)
        for part in (x[-1:], x[:1], x[rows // 2:rows // 2 + 3]):
            first = [i for i in range(rows) if np.array_equal(x[i], part[0])][0]
            np.testing.assert_array_equal(ops.packed_linear_lowp_fused(t(part), p).numpy(),
                                          out[first:first + len(part)])
        monkeypatch.setenv("PADDLE_RL_BF16_AMX", "0")
        avx512 = ops.packed_linear_lowp_fused(t(x), p).numpy()
        monkeypatch.delenv("PADDLE_RL_BF16_AMX")
        assert not np.array_equal(out, avx512)   # the tiles ran (their order of the sums, not the FMAs')


def test_packed_linear_low_precision_checks_its_inputs(rng):
    x, w = t(rng.standard_normal((2, 16))), t(rng.standard_normal((16, 40)))
    p = ops.pack_weight_lowp(w, False, "weight_only_int8", False)
    with pytest.raises(Exception, match="prl_packed_linear_lowp: int8 packed must be"):
        ops.packed_linear_lowp_fused(t(rng.standard_normal((2, 8))), p)
    p.n = 70
    with pytest.raises(Exception, match="prl_packed_linear_lowp: n 70 does not match 2 panels"):
        ops.packed_linear_lowp_fused(x, p)
    bf = ops.pack_weight_lowp(w, False, "bfloat16", True)
    bf.bf16_act = False
    with pytest.raises(Exception, match="bfloat16 weights multiply bfloat16 activations"):
        ops.packed_linear_lowp_fused(x, bf)
    with pytest.raises(ValueError, match="packed weight format: must be one of"):
        ops.pack_weight_lowp(w, False, "int8")
    with pytest.raises(ValueError, match="rollout_quant_type: must be '' .off., weight_only_int8 or weight_only_int4"):
        ops.rollout_weight_format("float32", "a8w8")


# ------------------------------------------------------------------------------------------------ decode layer

def _decode_layer_case(rng, rows, hidden, heads, kv, d, inter, fmt, qkv_bias, o_bias, qk_norm, cache_dtype, cap, slot):
    """Random weights of one dense layer packed as the rollout packs them (fmt: float32 panels or a LowpPacked),
    caches with `slot` earlier positions filled, and each row's start slot."""
    def pack(k, n):
        w = t(rng.standard_normal((k, n)) * 0.2)
        return ops.pack_weight(w) if fmt == "float32" else ops.pack_weight_lowp(w, False, fmt, fmt == "bfloat16")
    vec = (lambda n: t(1.0 + 0.1 * rng.standard_normal(n)))
    w = ops.DecodeLayerWeights(
        in_norm=vec(hidden), qkv=pack(hidden, (heads + 2 * kv) * d),
        qkv_bias=t(rng.standard_normal((heads + 2 * kv) * d) * 0.1) if qkv_bias else None,
        q_norm=vec(d) if qk_norm else None, k_norm=vec(d) if qk_norm else None, o=pack(heads * d, hidden),
        o_bias=t(rng.standard_normal(hidden) * 0.1) if o_bias else None, post_norm=vec(hidden),
        gate_up=pack(hidden, 2 * inter), down=pack(inter, hidden), num_heads=heads, num_kv_heads=kv, head_dim=d,
        hidden=hidden, intermediate=inter, eps=1e-6, qk_eps=1e-5, scale=d ** -0.5)
    x = t(rng.standard_normal((rows, 1, hidden)))
    positions = paddle.to_tensor(rng.integers(slot, 4000, (rows, 1)))
    caches = [t(rng.standard_normal((rows, kv, cap, d))).astype(cache_dtype) for _ in range(2)]
    start = paddle.to_tensor(rng.integers(0, slot + 1, rows))
    return x, w, positions, caches, start


# how the kernel splits a layer over the threads (csrc/cpu/decode_layer.cc SplitRows): each thread a share of the rows
# through the whole layer, each step in turn, or as the sizes say ("": float32 panels of these tests' small weights
# split the rows from ~10-20 rows on); low-precision packs always run the steps in turn
SPLITS = ["rows", "phases", ""]


# (rows, hidden, heads, kv, d, intermediate): the last case's rows are split over the threads in each row-wise step
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "weight_only_int8", "weight_only_int4"])
@pytest.mark.parametrize("rows,hidden,heads,kv,d,inter,qkv_bias,o_bias,qk_norm,cache_dtype", [
    (1, 64, 4, 2, 16, 96, True, False, False, "float32"),
    (5, 48, 3, 1, 16, 40, False, True, True, "bfloat16"),
    (7, 64, 4, 4, 8, 70, True, True, False, "float16"),
    (150, 128, 4, 2, 32, 172, True, False, True, "float32")])
def test_decode_layer_is_its_ops_bit_for_bit(monkeypatch, rng, split, fmt, rows, hidden, heads, kv, d, inter, qkv_bias,
                                             o_bias, qk_norm, cache_dtype):
    """The whole layer in one kernel call gives the bits of its ten op calls: the output, and the keys and values
    written into the caches (every slot; the ones it does not write unchanged), for every packed format, with and
    without the biases and q/k norms, over float32 and 16-bit caches, however the threads split the layer."""
    monkeypatch.setenv("PADDLE_RL_DECODE_LAYER_SPLIT", split)
    cap, slot = 9, 6
    x, w, positions, caches, start = _decode_layer_case(rng, rows, hidden, heads, kv, d, inter, fmt, qkv_bias, o_bias,
                                                        qk_norm, cache_dtype, cap, slot)
    inv_freq = _inv_freq(d)
    fused_caches = [c.clone() for c in caches]
    before = caches[0].astype("float32").numpy()
    out = ops.decode_layer_fused(x, w, positions, inv_freq, *fused_caches, start, slot)
    ref = ops.decode_layer_reference(x, w, positions, inv_freq, *caches, start, slot)
    assert out.shape == [rows, 1, hidden]
    np.testing.assert_array_equal(out.numpy(), ref.numpy())
    for fused, c in zip(fused_caches, caches):
        np.testing.assert_array_equal(fused.astype("float32").numpy(), c.astype("float32").numpy())
    after = fused_caches[0].astype("float32").numpy()
    assert not np.array_equal(after[:, :, slot], before[:, :, slot])    # the slot was written
    np.testing.assert_array_equal(np.delete(after, slot, axis=2), np.delete(before, slot, axis=2))
    # the dispatch runs the kernel for these tensors, and a row's result is its own (the same bits alone)
    np.testing.assert_array_equal(ops.decode_layer(x, w, positions, inv_freq, *[c.clone() for c in caches], start,
                                                   slot).numpy(), out.numpy())
    alone = ops.decode_layer_fused(x[-1:], w, positions[-1:], inv_freq, *[c[-1:].clone() for c in caches],
                                   start[-1:], slot)
    np.testing.assert_array_equal(alone.numpy(), out.numpy()[-1:])


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cache_dtype,d", [("float32", 64), ("bfloat16", 16), ("float32", 12)])
def test_decode_layer_reads_a_shared_prompt_from_its_row(monkeypatch, rng, split, cache_dtype, d):
    """Rows that share a prompt (`shared`: its samples) read its slots from the row named: the same bits as each row
    reading its own copy, and a row whose own copy differs there is computed from the named row's (so the kernel
    reads them there, also where another thread takes the named row: rows 3 and 0 with the rows split over 2
    threads). The windows start at different slots and the shared spans end inside a block of keys (d 64: the vector
    paths, 12: the scalar ones)."""
    monkeypatch.setenv("PADDLE_RL_DECODE_LAYER_SPLIT", split)
    rows, cap, slot, prompt_end = 6, 40, 33, 13
    x, w, positions, caches, start = _decode_layer_case(rng, rows, 64, 4, 2, d, 40, "float32", True, False, False,
                                                        cache_dtype, cap, slot)
    start = paddle.to_tensor(np.array([2, 2, 2, 2, 5, 0], dtype=np.int64))
    source = np.array([0, 0, 0, 0, 4, 5])   # rows 0-3 share one prompt, rows 4 and 5 their own
    ends = np.array([prompt_end, prompt_end, prompt_end, prompt_end, prompt_end + 7, 9])
    for c in caches:   # each row's prompt slots copied from its source row (as a prefill fans a prompt out)
        data = c.astype("float32").numpy()
        for r in range(rows):
            data[r, :, :ends[r]] = data[source[r], :, :ends[r]]
        c.set_value(paddle.to_tensor(data).astype(cache_dtype))
    shared = paddle.to_tensor(np.stack([source, ends], axis=1).astype(np.int64))
    inv_freq = _inv_freq(d)
    own = ops.decode_layer_fused(x, w, positions, inv_freq, *[c.clone() for c in caches], start, slot)
    read = ops.decode_layer_fused(x, w, positions, inv_freq, *[c.clone() for c in caches], start, slot, shared)
    np.testing.assert_array_equal(read.numpy(), own.numpy())
    np.testing.assert_array_equal(ops.decode_layer_reference(x, w, positions, inv_freq, *[c.clone() for c in caches],
                                                             start, slot, shared).numpy(), own.numpy())
    # rows 1 and 3 hold other numbers in the first 8 slots of their windows (whole blocks of keys read from the
    # source row: a block that straddles the end of the shared span reads the row's own copy, the same numbers)
    spoiled = [c.clone() for c in caches]
    for c in spoiled:
        data = c.astype("float32").numpy()
        for r in (1, 3):
            data[r, :, int(start[r]):int(start[r]) + 8] += 1.0
        c.set_value(paddle.to_tensor(data).astype(cache_dtype))
    got = ops.decode_layer_fused(x, w, positions, inv_freq, *[c.clone() for c in spoiled], start, slot, shared)
    np.testing.assert_array_equal(got.numpy(), own.numpy())
    alone = ops.decode_layer_fused(x, w, positions, inv_freq, *[c.clone() for c in spoiled], start, slot)
    assert not np.array_equal(alone.numpy()[[1, 3]], own.numpy()[[1, 3]])
    np.testing.assert_array_equal(alone.numpy()[[0, 2, 4, 5]], own.numpy()[[0, 2, 4, 5]])
    with pytest.raises(Exception, match="prl_decode_layer: shared row out of range"):
        ops.decode_layer_fused(x, w, positions, inv_freq, *caches, start, slot,
                               paddle.to_tensor(np.array([[0, 1]] * (rows - 1) + [[rows, 1]], dtype=np.int64)))


def test_decode_layer_checks_its_inputs(rng):
    x, w, positions, caches, start = _decode_layer_case(rng, 3, 32, 4, 2, 8, 40, "weight_only_int8", True, False,
                                                        False, "float32", 6, 2)
    inv_freq = _inv_freq(8)
    with pytest.raises(Exception, match="prl_decode_layer: slot 6 and length 7"):
        ops.decode_layer_fused(x, w, positions, inv_freq, *caches, start, 6)
    with pytest.raises(Exception, match="prl_decode_layer: caches must be"):
        ops.decode_layer_fused(x, w, positions, inv_freq, caches[0][:2], caches[1][:2], start, 2)
    bad = ops.DecodeLayerWeights(**{**w.__dict__, "o": ops.LowpPacked(w.o.data, w.o.scales[:5], w.o.format, w.o.n,
                                                                     w.o.bf16_act)})
    with pytest.raises(Exception, match="prl_decode_layer: o: a weight_only_int8 pack needs its 32 float32 scales"):
        ops.decode_layer_fused(x, bad, positions, inv_freq, *caches, start, 2)
    bad = ops.DecodeLayerWeights(**{**w.__dict__, "qkv_bias": t(np.zeros(7))})
    with pytest.raises(Exception, match="prl_decode_layer: qkv_bias must have 64 elements"):
        ops.decode_layer_fused(x, bad, positions, inv_freq, *caches, start, 2)


# ------------------------------------------------------------------------------------------------ residual add

def test_residual_add_shares_its_gradient(rng):
    """x + y's backward passes one tensor to both inputs; with x also read elsewhere (as a residual stream is, by
    the next norm) the gradients equal Paddle's add's bit for bit. The sum overwrites y."""
    x = t(rng.standard_normal((5, 8)), grad=True)
    w = t(rng.standard_normal((8, 8)), grad=True)
    g = t(rng.standard_normal((5, 8)))
    got = {}
    for name, add in (("residual", ops.residual_add), ("paddle", ops.residual_add_reference)):
        h = paddle.tanh(x)
        out = add(h, paddle.matmul(ops.rms_norm_reference(h, paddle.ones([8]), 1e-6), w))
        out = add(out, paddle.sin(out))
        got[name] = [a.numpy() for a in paddle.grad(out, [x, w], g)]
    for a, b in zip(got["residual"], got["paddle"]):
        np.testing.assert_array_equal(a, b)
    # the sum is written over y (no new tensor), with and without a recorded gradient
    for grad in (True, False):
        y = paddle.sin(x)
        if not grad:
            x, y = x.detach(), y.detach()
        before = y.numpy() + x.numpy()
        out = ops.residual_add(x, y)
        np.testing.assert_array_equal(y.numpy(), before)
        np.testing.assert_array_equal(out.numpy(), before)
    # a y its maker saved for its backward (exp keeps its output): Paddle refuses the backward, loudly
    x = t(rng.standard_normal((5, 8)), grad=True)
    e = paddle.exp(x)
    with pytest.raises(RuntimeError, match="inplace"):
        paddle.grad(ops.residual_add(x, e), [x], g)


@pytest.mark.parametrize("recompute", [None, "full", "full_attn", "core_attn_mlp"])
def test_model_gradients_with_residual_add(rng, monkeypatch, recompute):
    """The decoder's gradients with the shared-gradient residual add equal those with Paddle's add, bit for bit,
    under each recompute setting (the recomputed blocks read the residual stream's tensors again)."""
    model = _training_decoder(seed=3, vocab=90, layers=3)
    model.recompute = recompute
    ids = paddle.to_tensor(rng.integers(0, 90, (2, 9)))
    mask = paddle.to_tensor(np.array([[1] * 9, [0] * 2 + [1] * 7]))
    grads = {}
    for name in ("residual", "paddle"):
        with monkeypatch.context() as m:
            if name == "paddle":
                m.setattr(ops, "residual_add", ops.residual_add_reference)
            logp, _ = token_logprobs(model, ids, mask, 3, ids[:, 3:], 1.0)
            logp.sum().backward()
        grads[name] = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        model.clear_gradients()
    assert grads["residual"].keys() == grads["paddle"].keys()
    for n, ref in grads["paddle"].items():
        np.testing.assert_array_equal(grads["residual"][n], ref, err_msg=n)
