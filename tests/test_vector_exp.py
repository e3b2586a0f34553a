"""The vector exp of the CPU kernels (prl::ExpF8 / ExpD4 in csrc/prl_common.h) against the scalar one (ExpF /
ExpD) and float64 numpy, through the ops that use it.

A kernel takes a row 8 lanes at a time by the vector exp and its last (length % 8) elements one by one by the
scalar exp. Rows here hold the same values in a vector block and in the scalar tail, so the outputs of both must be
equal bit for bit; inputs span -100..100 with the clamp edges (-87.33654, 88) on both sides.
"""
import numpy as np
import paddle
import pytest

from paddle_rl import ops
from paddle_rl.ops import build
from paddle_rl.ops import logprob as logprob_module

# values around the float32 clamp (exp is exactly 0 below -87.33654, exp(88) above 88), zero, tiny and large ones
EDGES = np.array([-100.0, -88.0, -87.33655, -87.33654, -87.3365, -87.0, -20.0, -1e-30, 0.0, 1e-30, 0.5, 20.0,
                  87.9, 88.0, 88.0001, 100.0], dtype=np.float32)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    previous = build.mode()
    ops.configure("on")
    yield
    ops.configure(previous)


def t(array, dtype="float32", grad=False):
    out = paddle.to_tensor(np.ascontiguousarray(array).astype(dtype))
    out.stop_gradient = not grad
    return out


def twin_rows(rng, rows: int, tail: int, blocks: int = 2, spread: float = 100.0):
    """[rows, 8 * blocks + tail] float32: random values in [-spread, spread] (the EDGES in the first rows), the
    first `tail` columns repeated in the last `tail` (the scalar tail)."""
    x = rng.uniform(-spread, spread, (rows, 8 * blocks + tail)).astype(np.float32)
    edges = np.resize(EDGES, rows * tail).reshape(rows, tail)
    x[: min(rows, len(EDGES)), :tail] = edges[: min(rows, len(EDGES))]
    x[:, -tail:] = x[:, :tail]
    return x


def assert_twins_equal(out, tail: int, what: str):
    """The first `tail` columns of out equal its last `tail` columns bit for bit."""
    out = np.asarray(out)
    head, back = out[:, :tail].view(np.uint32), out[:, -tail:].view(np.uint32)
    differ = np.argwhere(head != back)
    assert differ.size == 0, (f"{what}: the vector exp and the scalar one differ at {len(differ)} places, first "
                              f"{out[tuple(differ[0])]!r} vs {out[differ[0][0], out.shape[1] - tail + differ[0][1]]!r}")


def test_swiglu_vector_lanes_equal_the_scalar_tail_and_float64(rng=np.random.default_rng(7)):
    f_tail, rows = 5, 64
    gate = twin_rows(rng, rows, f_tail)
    up = twin_rows(rng, rows, f_tail, spread=3.0)
    x = t(np.concatenate([gate, up], axis=1), grad=True)
    out = ops.swiglu_fused(x)
    assert_twins_equal(out.numpy(), f_tail, "swiglu forward")
    g64, u64 = gate.astype(np.float64), up.astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-g64))
    ref = g64 * sig * u64
    # ExpF's relative error (~2e-7) and a few float32 roundings; beyond the clamp (gate < -88) exp(-gate) stops at
    # exp(88), the output there is below 1e-33 (|gate|, |up| <= 100) against the reference's smaller one
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-33)
    grad_out = np.ones_like(up)
    grad_out[:, -f_tail:] = grad_out[:, :f_tail] = rng.uniform(-2, 2, (rows, f_tail))
    out.backward(t(grad_out))
    dx = x.grad.numpy()
    width = gate.shape[1]
    assert_twins_equal(dx[:, :width], f_tail, "swiglu d gate")
    assert_twins_equal(dx[:, width:], f_tail, "swiglu d up")
    go = grad_out.astype(np.float64)
    np.testing.assert_allclose(dx[:, :width], go * u64 * sig * (1 + g64 * (1 - sig)), rtol=2e-6, atol=1e-33)
    np.testing.assert_allclose(dx[:, width:], go * g64 * sig, rtol=2e-6, atol=1e-33)


def test_logprob_with_large_logits_vector_equals_scalar(rng=np.random.default_rng(8)):
    """The log-prob chunk's forward (sums of exp over the vocabulary) against float64, and its backward's vector
    lanes against its scalar tail, with logits far beyond the clamp (spread 300: most exp(z - max) are exactly 0)."""
    tail, rows = 3, 16
    for spread in (3.0, 300.0):
        logits = twin_rows(rng, rows, tail, blocks=5, spread=spread)
        vocab = logits.shape[1]
        labels = rng.integers(tail, vocab - tail, rows).astype(np.int64)  # away from the twin columns
        logp, entropy, lse, mean_z = logprob_module.chunk_forward_fused(t(logits), t(labels, "int64"), 1.0)
        z = logits.astype(np.float64)
        m = z.max(axis=1, keepdims=True)
        ref_lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
        p = np.exp(z - ref_lse[:, None])
        np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-6)
        np.testing.assert_allclose(logp.numpy(), z[np.arange(rows), labels] - ref_lse, rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(entropy.numpy(), ref_lse - (p * z).sum(axis=1), rtol=1e-5, atol=1e-5)
        ones = t(np.ones(rows))
        grad = logprob_module.chunk_backward_fused(t(logits), t(labels, "int64"), lse, mean_z, ones, ones, 1.0)
        assert_twins_equal(grad.numpy(), tail, f"logprob backward (spread {spread})")
        ref_grad = -p - p * (z - (p * z).sum(axis=1, keepdims=True))
        ref_grad[np.arange(rows), labels] += 1.0
        np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-5 * max(1.0, spread))


def test_masked_softmax_and_decode_attention_vector_equals_scalar(rng=np.random.default_rng(9)):
    tail, length = 7, 4
    scores = twin_rows(rng, 2 * 2 * length, tail, blocks=3, spread=100.0).reshape(2, 2, length, -1)
    keys = scores.shape[-1]
    bias = np.zeros((2, 1, length, keys), np.float32)
    out = ops.masked_softmax_fused(t(scores), t(bias), 1.0).numpy().reshape(-1, keys)
    assert_twins_equal(out, tail, "masked_softmax")
    z = scores.reshape(-1, keys).astype(np.float64)
    ref = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, ref / ref.sum(axis=1, keepdims=True), rtol=2e-6, atol=1e-30)
    # decode attention: one query head; the keys' scores are twin rows (q = e_0, k[:, 0] = scores); value t is the
    # unit vector e_(1 + j) for the vector block's twin j, e_(8 + j) for the scalar tail's: out = their
    # probabilities, one product each (no sum to reorder)
    batch, d = 2, 16
    s = twin_rows(rng, batch, tail, blocks=3, spread=100.0)
    cap = s.shape[1]
    q = np.zeros((batch, 1, 1, d), np.float32)
    q[..., 0] = 1.0
    cache_k = np.zeros((batch, 1, cap, d), np.float32)
    cache_k[:, 0, :, 0] = s
    cache_v = np.zeros((batch, 1, cap, d), np.float32)
    for j in range(tail):
        cache_v[:, 0, j, 1 + j] = 1.0
        cache_v[:, 0, cap - tail + j, 8 + j] = 1.0
    out = ops.decode_attention_fused(t(q), t(cache_k), t(cache_v), t(np.zeros(batch), "int64"), cap, 1.0).numpy()
    out = out.reshape(batch, d)
    assert_twins_equal(np.concatenate([out[:, 1:1 + tail], out[:, 8:8 + tail]], axis=1), tail, "decode attention")
    p = np.exp(s.astype(np.float64) - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out[:, 8:8 + tail], p[:, -tail:], rtol=2e-6, atol=1e-30)


def test_sampling_logprob_against_float64(rng=np.random.default_rng(10)):
    """prl_sample's softmax runs in float64 (ExpD4 4 lanes at a time, the rest by ExpD): the draw's log-prob is
    float64 log_softmax at the drawn token, rounded once to float32."""
    for spread in (2.0, 40.0):
        logits = rng.uniform(-spread, spread, (6, 4 * 37 + 3)).astype(np.float32)
        uniforms = rng.random(6).astype(np.float32)
        for temperature in (1.0, 0.7):
            tokens, logp = ops.sample_fused(t(logits), t(uniforms), temperature=temperature)
            z = logits.astype(np.float64) / np.float64(np.float32(temperature))
            m = z.max(axis=1, keepdims=True)
            log_softmax = z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))
            ref = log_softmax[np.arange(6), tokens.numpy()].astype(np.float32)
            np.testing.assert_array_max_ulp(logp.numpy(), ref, maxulp=1)
            # the inverse-CDF draw: the first token whose cumulative probability exceeds the uniform
            cdf = np.cumsum(np.exp(log_softmax), axis=1)
            expected = (cdf <= uniforms[:, None].astype(np.float64)).sum(axis=1)
            np.testing.assert_array_equal(tokens.numpy(), np.minimum(expected, logits.shape[1] - 1))
