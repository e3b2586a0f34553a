"""The RL objective chosen by a config: score shaping, advantages, and the per-micro-batch loss.

The trainer talks only to `Objective`; the math lives in the registries of advantages.py,
kl.py, losses.py and aggregation.py.
"""
from dataclasses import dataclass

import numpy as np
import paddle

from .advantages import ADVANTAGE_ESTIMATORS
from .aggregation import aggregate_loss
from .kl import kl_penalty
from .losses import masked_mean, policy_loss

PRESET_ESTIMATOR = {"grpo": "grpo", "reinforce_plus_plus": "reinforce_plus_plus"}


@dataclass
class LossOutput:
    loss: paddle.Tensor   # this micro-batch's share of the mini-batch loss (sum over micro-batches = total)
    metrics: dict         # token-mean metrics of this micro-batch (python floats)
    num_tokens: float


class Objective:
    def __init__(self, config):
        self.config = config
        self.estimator = config.advantage_estimator or PRESET_ESTIMATOR[config.rl_algorithm]
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator: unknown {self.estimator!r} "
                             f"(choose from {', '.join(ADVANTAGE_ESTIMATORS)})")
        self.loss_agg_mode = config.loss_agg_mode or "token-mean"
        low = config.clip_range_ratio_low
        high = config.clip_range_ratio_high
        self.clip_low = config.clip_range_ratio if low is None else low
        self.clip_high = config.clip_range_ratio if high is None else high

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coeff > 0 or self.config.kl_loss_coeff > 0

    # --- rollout side -------------------------------------------------------------------------
    def shape_scores(self, scores: np.ndarray, lengths: np.ndarray, truncated: np.ndarray):
        """Scores after clipping; returns (scores, metrics)."""
        clip = self.config.clip_range_score
        return np.clip(scores, -clip, clip).astype(np.float32), {}

    def advantages(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None):
        fn = ADVANTAGE_ESTIMATORS[self.estimator]
        return fn(scores, response_mask, group_ids, old_logp=old_logp, ref_logp=ref_logp,
                  kl_coeff=self.config.kl_coeff, gamma=self.config.gamma, eps=self.config.grpo_eps,
                  clip_range_score=self.config.clip_range_score)

    # --- update side --------------------------------------------------------------------------
    def loss(self, logp, old_logp, ref_logp, advantages, response_mask, entropy, num_tokens, num_seqs) -> LossOutput:
        cfg = self.config
        mask = response_mask.astype("float32")
        pg, metrics = policy_loss(cfg.policy_loss, logp, old_logp, advantages, mask,
                                  clip_low=self.clip_low, clip_high=self.clip_high)
        total = cfg.pg_loss_coeff * pg
        with paddle.no_grad():
            metrics["pg_loss"] = masked_mean(pg, mask)
            metrics["entropy"] = masked_mean(entropy, mask)
        if cfg.kl_loss_coeff > 0:
            kl = kl_penalty(logp, ref_logp, cfg.kl_loss_type)
            total = total + cfg.kl_loss_coeff * kl
            with paddle.no_grad():
                metrics["kl_loss"] = masked_mean(kl, mask)
        if cfg.entropy_coeff:
            total = total - cfg.entropy_coeff * entropy
        loss = aggregate_loss(total, mask, self.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                              loss_scale_factor=cfg.max_dec_len)
        return LossOutput(loss, {k: float(v) for k, v in metrics.items()}, float(mask.sum()))

    def state_dict(self) -> dict:
        return {}

    def set_state_dict(self, state: dict) -> None:
        pass
