"""Logits processing and sampling for one decode step. Pure tensor functions.

Sampling is an inverse-CDF draw with a uniform number supplied per row, so the drawn token
depends only on the row's key (see keys.py), never on batch layout or process rank.
"""
from dataclasses import dataclass, field
from typing import List

import paddle
import paddle.nn.functional as F

NEG_INF = -1e9


@dataclass
class SamplingParams:
    max_dec_len: int = 64
    min_dec_len: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: List[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @classmethod
    def from_config(cls, config, stop_token_ids, greedy: bool = False, max_dec_len=None):
        return cls(max_dec_len=max_dec_len or config.max_dec_len, min_dec_len=0 if greedy else config.min_dec_len,
                   temperature=0.0 if greedy else config.temperature, top_p=config.top_p, top_k=config.top_k,
                   repetition_penalty=1.0 if greedy else config.repetition_penalty,
                   stop_token_ids=sorted(set(stop_token_ids) | set(config.stop_token_ids)))


def apply_repetition_penalty(logits, seen, penalty: float):
    """CTRL penalty on tokens already present (seen: [B, V] float 0/1)."""
    if penalty == 1.0:
        return logits
    penalized = paddle.where(logits > 0, logits / penalty, logits * penalty)
    return paddle.where(seen > 0, penalized, logits)


def ban_tokens(logits, token_ids, rows=None):
    """Set the logits of token_ids to NEG_INF (for every row, or rows where the bool mask `rows` holds)."""
    if not token_ids:
        return logits
    ban = paddle.zeros([logits.shape[-1]], dtype="bool")
    ban = paddle.scatter(ban.astype("int32"), paddle.to_tensor(token_ids, dtype="int64"),
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
    """Keep the smallest set of most likely tokens whose mass reaches p (the top token always stays)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = paddle.sort(logits, axis=-1, descending=True), paddle.argsort(logits, axis=-1, descending=True)
    probs = F.softmax(sorted_logits, axis=-1)
    mass_before = paddle.cumsum(probs, axis=-1) - probs
    drop_sorted = mass_before >= p
    drop = paddle.put_along_axis(paddle.zeros_like(drop_sorted.astype("int32")), order,
                                 drop_sorted.astype("int32"), axis=-1)
    return paddle.where(drop.astype("bool"), paddle.full_like(logits, NEG_INF), logits)


def draw(logits, uniforms):
    """Inverse-CDF sample of softmax(logits) with one uniform in [0, 1) per row."""
    probs = F.softmax(logits, axis=-1)
    cdf = paddle.cumsum(probs, axis=-1)
    threshold = uniforms.unsqueeze(-1) * cdf[:, -1:]
    index = (cdf <= threshold).astype("int64").sum(axis=-1)
    return paddle.clip(index, max=logits.shape[-1] - 1)


def sampled_logprob(logits, tokens, temperature: float):
    """log softmax(logits / T) at the drawn tokens (the policy the trainer optimizes; no filtering)."""
    scaled = logits / temperature if temperature > 0 else logits
    logp = F.log_softmax(scaled, axis=-1)
    return paddle.take_along_axis(logp, tokens.unsqueeze(-1), axis=-1).squeeze(-1)


def next_tokens(logits, params: SamplingParams, seen, uniforms, ban_eos_rows=None, eos_ids=()):
    """One decode step: (tokens [B], logprob [B]) from raw logits [B, V]."""
    processed = apply_repetition_penalty(logits, seen, params.repetition_penalty) if seen is not None else logits
    if ban_eos_rows is not None:
        processed = ban_tokens(processed, list(eos_ids), ban_eos_rows)
    if params.greedy:
        tokens = paddle.argmax(processed, axis=-1)
    else:
        processed = processed / params.temperature
        processed = top_k_filter(processed, params.top_k)
        processed = top_p_filter(processed, params.top_p)
        tokens = draw(processed, uniforms)
    return tokens, sampled_logprob(logits, tokens, params.temperature)
