"""One decode step of sampling: repetition penalty, stop-token ban, temperature, top-k, top-p and an
inverse-CDF draw with one supplied uniform per row, plus the log-prob of the drawn token.

The drawn token depends only on the row's logits and uniform. Everything after the temperature runs in
float64 (the temperature and top_p are taken as float32 numbers, as the fused kernel receives them), so
the fused kernel and this reference agree unless a uniform falls within ~1e-15 of a CDF step.
Top-p keeps every token at least as likely as the last token whose preceding mass (in descending order)
is below top_p, so tied logits are kept or dropped together.
"""
import numpy as np
import paddle
import paddle.nn.functional as F

from . import build
from ._util import contiguous, fusable

NEG_INF = -1e9


def apply_repetition_penalty(logits, seen, penalty: float):
    """CTRL penalty on tokens already present (seen: [B, V] float 0/1)."""
    if penalty == 1.0:
        return logits
    penalized = paddle.where(logits > 0, logits / penalty, logits * penalty)
    return paddle.where(seen > 0, penalized, logits)


def ban_tokens(logits, token_ids, rows=None):
    """Set the logits of token_ids to NEG_INF (for every row, or rows where the bool mask `rows` holds)."""
    token_ids = [int(t) for t in token_ids if 0 <= int(t) < logits.shape[-1]]
    if not token_ids:
        return logits
    ban = paddle.zeros([logits.shape[-1]], dtype="int32")
    ban = paddle.scatter(ban, paddle.to_tensor(token_ids, dtype="int64"),
                         paddle.ones([len(token_ids)], dtype="int32")).astype("bool").unsqueeze(0)
    if rows is not None:
        ban = paddle.logical_and(ban, rows.unsqueeze(-1))
    return paddle.where(ban, paddle.full_like(logits, NEG_INF), logits)


def top_k_filter(logits, k: int):
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = paddle.topk(logits, k, axis=-1)[0][:, -1:]
    return paddle.where(logits < kth, paddle.full_like(logits, NEG_INF), logits)


def top_p_filter(logits, p: float):
    """Keep the most likely tokens until the mass before the next one reaches p (the top token always stays;
    tokens tied with the last kept one stay too)."""
    if p >= 1.0:
        return logits
    sorted_logits = paddle.sort(logits, axis=-1, descending=True)
    probs = F.softmax(sorted_logits, axis=-1)
    mass_before = paddle.cumsum(probs, axis=-1) - probs
    kept = (mass_before < p).astype("int64").sum(axis=-1, keepdim=True)
    cut = paddle.take_along_axis(sorted_logits, kept - 1, axis=-1)
    return paddle.where(logits < cut, paddle.full_like(logits, NEG_INF), logits)


def draw(logits, uniforms):
    """Inverse-CDF sample of softmax(logits) with one uniform in [0, 1) per row."""
    probs = F.softmax(logits, axis=-1)
    cdf = paddle.cumsum(probs, axis=-1)
    threshold = uniforms.astype(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    index = (cdf <= threshold).astype("int64").sum(axis=-1)
    return paddle.clip(index, max=logits.shape[-1] - 1)


def sampled_logprob(logits, tokens, temperature: float):
    """log softmax(logits / T) at the drawn tokens (the policy the trainer optimizes; no filtering)."""
    scaled = logits / temperature if temperature > 0 else logits
    top = scaled.max(axis=-1, keepdim=True)
    lse = (scaled - top).exp().sum(axis=-1, keepdim=True).log() + top
    return (paddle.take_along_axis(scaled, tokens.unsqueeze(-1), axis=-1) - lse).squeeze(-1)


def _f32(value: float) -> float:
    return float(np.float32(value))


def sample_reference(logits, uniforms=None, seen=None, ban_rows=None, stop_ids=(), temperature: float = 1.0,
                     top_k: int = 0, top_p: float = 1.0, penalty: float = 1.0):
    """(tokens [B] int64, logprob [B] float32) from raw logits [B, V]; greedy when temperature <= 0."""
    processed = logits
    if seen is not None and penalty != 1.0:
        processed = apply_repetition_penalty(processed, seen, penalty)
    if ban_rows is not None:
        processed = ban_tokens(processed, list(stop_ids), ban_rows)
    if temperature <= 0:
        tokens = paddle.argmax(processed, axis=-1)
    else:
        if uniforms is None:
            raise ValueError("sampling needs one uniform per row")
        z = processed.astype("float64") / _f32(temperature)
        z = top_k_filter(z, top_k)
        z = top_p_filter(z, _f32(top_p))
        tokens = draw(z, uniforms)
    return tokens, sampled_logprob(logits, tokens, temperature)


def sample_fused(logits, uniforms=None, seen=None, ban_rows=None, stop_ids=(), temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, penalty: float = 1.0):
    if not isinstance(stop_ids, paddle.Tensor):
        stop_ids = paddle.to_tensor(np.asarray(list(stop_ids), dtype=np.int64).reshape([-1]))
    if temperature > 0 and uniforms is None:
        raise ValueError("sampling needs one uniform per row")
    seen = seen if (seen is not None and penalty != 1.0) else None
    tokens, logprob = build.run("prl_sample", contiguous(logits), seen, uniforms, ban_rows, stop_ids,
                                float(max(temperature, 0.0)), int(top_k), float(top_p), float(penalty))
    return tokens, logprob


def sample(logits, uniforms=None, seen=None, ban_rows=None, stop_ids=(), temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, penalty: float = 1.0):
    """The fused kernel when available, else `sample_reference` (same results; see the module docstring)."""
    if logits.ndim == 2 and fusable(logits, seen):
        return sample_fused(logits, uniforms, seen, ban_rows, stop_ids, temperature, top_k, top_p, penalty)
    if isinstance(stop_ids, paddle.Tensor):
        stop_ids = stop_ids.numpy().tolist()
    return sample_reference(logits, uniforms, seen, ban_rows, stop_ids, temperature, top_k, top_p, penalty)
