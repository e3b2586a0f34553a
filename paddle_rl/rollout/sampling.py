"""Sampling parameters and the per-step sampling call of the rollout.

Sampling is an inverse-CDF draw with a uniform number supplied per row, so the drawn token depends only on
the row's key (see keys.py), never on batch layout or process rank. The math (repetition penalty, stop-token
ban, temperature, top-k, top-p, draw, log-prob of the draw) lives in paddle_rl/ops/sampling.py as one fused
kernel with a pure-Paddle reference.
"""
from dataclasses import dataclass, field
from typing import List

from .. import ops


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


def next_tokens(logits, params: SamplingParams, seen, uniforms, ban_eos_rows=None, eos_ids=()):
    """One decode step: (tokens [B], logprob [B]) from raw logits [B, V]."""
    return ops.sample(logits, uniforms, seen, ban_eos_rows, eos_ids, params.temperature, params.top_k, params.top_p,
                      params.repetition_penalty)
