"""The RL objective chosen by a config: score shaping, advantages, the per-micro-batch loss, DAPO filters.

The trainer talks only to `Objective`; the math lives in the registries of advantages.py, kl.py,
losses.py and aggregation.py, and the DAPO pieces in dapo.py.

Data-parallel contract: every call sees this rank's shard of the batch, with every response of a
prompt group on the same rank. Batch-wide statistics (REINFORCE++ whitening, scale_rewards=batch,
gdpo, normalize_advantage, normalize_reward's running moments, the observed reward KL) are summed
over ranks through `reduce` ("auto": the default group when paddle.distributed is initialized with
world size > 1; pass the data-parallel group when tensor/pipeline ranks hold copies of the same data;
None: the caller already holds the whole batch).
"""
import logging
from dataclasses import dataclass

import numpy as np
import paddle

from ._tensor import as_tensor, metrics_to_floats, to_numpy
from .advantages import ADVANTAGE_ESTIMATORS, reward_kl_per_token
from .aggregation import aggregate_loss, loss_normalizers
from .dapo import overlong_filtered_mask, select_groups, soft_overlong_penalty, zero_variance_groups
from .kl import AdaptiveKLController, FixedKLController, kl_penalty
from .losses import masked_mean, policy_loss_tensors
from .stats import RunningMoments, global_sum, masked_whiten

logger = logging.getLogger("paddle_rl")

REWARD_NORM_EPS = 1e-8


@dataclass
class LossOutput:
    loss: paddle.Tensor   # this micro-batch's share of the mini-batch loss (sum over micro-batches = total)
    metrics: dict         # token means over this micro-batch (python floats); weight them by num_tokens
    num_tokens: float     # response tokens of this micro-batch


class Objective:
    """Everything the trainer needs from the algorithm side, configured by the `algorithm` keys."""

    def __init__(self, config, reduce="auto"):
        self.config = config
        self.reduce = reduce
        self.estimator = config.resolved_estimator
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator: unknown {self.estimator!r} "
                             f"(choose from {', '.join(ADVANTAGE_ESTIMATORS)})")
        self.loss_agg_mode = config.resolved_loss_agg_mode
        self.loss_scale_factor = config.resolved_loss_scale_factor
        self.grpo_eps = config.resolved_grpo_eps
        self.kl_loss_coeff = config.loss_kl_coeff
        self.normalize_reward, self.normalize_advantage = config.score_normalization
        low, high = config.clip_range_ratio_low, config.clip_range_ratio_high
        self.clip_low = config.clip_range_ratio if low is None else low
        self.clip_high = config.clip_range_ratio if high is None else high
        self.kl_controller = (AdaptiveKLController(config.kl_coeff, config.kl_target, config.kl_horizon)
                              if config.adaptive_kl else FixedKLController(config.kl_coeff))
        self.reward_moments = RunningMoments()
        self._warn_ignored()

    def _warn_ignored(self):
        cfg = self.config
        if cfg.kl_loss_coeff > 0 and self.kl_loss_coeff == 0:
            logger.warning("kl_loss_coeff: not applied with rl_algorithm reinforce_plus_plus (KL enters the reward "
                           "through kl_coeff); set advantage_estimator: reinforce_plus_plus to add a loss KL too")
        ignored = [k for k, on, used in (("normalize_reward", cfg.normalize_reward, self.normalize_reward),
                                         ("normalize_advantage", cfg.normalize_advantage, self.normalize_advantage))
                   if on and not used]
        if ignored:
            logger.warning("%s: not applied with rl_algorithm grpo (as in PaddleNLP); set advantage_estimator: grpo "
                           "to apply", ", ".join(ignored))

    # --- properties --------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coeff > 0 or self.kl_loss_coeff > 0

    @property
    def kl_coeff(self) -> float:
        """The reward KL coefficient in effect (moves when adaptive_kl is on)."""
        return self.kl_controller.value

    @property
    def conventions(self) -> dict:
        """The resolved settings of this run (for logging and docs)."""
        return {"estimator": self.estimator, "algorithm_preset": self.config.algorithm_preset,
                "grpo_eps": self.grpo_eps, "std_ddof": 1, "whitening": "token-weighted, global",
                "loss_agg_mode": self.loss_agg_mode, "loss_scale_factor": self.loss_scale_factor,
                "kl_in_reward": self.config.kl_coeff > 0, "kl_in_loss": self.kl_loss_coeff > 0,
                "normalize_reward": self.normalize_reward, "normalize_advantage": self.normalize_advantage}

    # --- rollout side ------------------------------------------------------------------------
    def shape_scores(self, scores: np.ndarray, lengths: np.ndarray, truncated: np.ndarray):
        """Scores -> (+ soft overlong penalty) -> (running normalization) -> clip. Returns (float32 [B], metrics).

        The running moments are updated with this batch (gathered over ranks) before normalizing it.
        """
        cfg = self.config
        s = to_numpy(scores)
        truncated = to_numpy(truncated, dtype=bool).reshape(-1)
        metrics = {"truncated_share": float(truncated.mean()) if truncated.size else 0.0,
                   "score/raw_mean": float(s.mean()) if s.size else 0.0}
        if cfg.enable_overlong_reward_buffer:
            penalty = soft_overlong_penalty(lengths, cfg.max_dec_len, cfg.overlong_reward_buffer,
                                            cfg.overlong_penalty_factor)
            s = s + penalty
            metrics["overlong_penalty_mean"] = float(penalty.mean()) if penalty.size else 0.0
        if self.normalize_reward:
            self.reward_moments.update(s, self.reduce)
            s = (s - self.reward_moments.mean) / np.sqrt(self.reward_moments.var + REWARD_NORM_EPS)
            metrics["reward_running_mean"] = float(self.reward_moments.mean)
            metrics["reward_running_std"] = self.reward_moments.std
        clip = cfg.clip_range_score
        metrics["score_clip_share"] = float((np.abs(s) > clip).mean()) if s.size else 0.0
        s = np.clip(s, -clip, clip)
        metrics["score/shaped_mean"] = float(s.mean()) if s.size else 0.0
        return s.astype(np.float32), metrics

    def filter_groups(self, scores, group_ids):
        """DAPO dynamic sampling: (keep [B] bool, metrics). Groups of two or more whose score variance is
        <= 1e-6 are dropped when dynamic_sampling is on; otherwise everything is kept. The metric
        zero_variance_group_share is reported either way."""
        keep, share = zero_variance_groups(scores, group_ids)
        if not self.config.dynamic_sampling:
            keep = np.ones_like(keep)
        return keep, {"zero_variance_group_share": float(share), "kept_share": float(keep.mean()) if keep.size else 0.0}

    def select_groups(self, keep, group_ids, target_groups: int, gen_round: int):
        """Indices of the training batch among the responses generated so far, or None to generate more.

        gen_round counts from 1; at gen_round >= max_gen_batches the dynamic_sampling_fallback applies
        (error: raise; keep: fill up with zero-variance groups).
        """
        final = gen_round >= self.config.max_gen_batches
        return select_groups(keep, group_ids, target_groups, final, self.config.dynamic_sampling_fallback)

    def response_mask_for_update(self, response_mask, truncated):
        """The mask the loss uses: truncated responses zeroed when overlong_filter is on (same type back)."""
        if not self.config.overlong_filter:
            return response_mask
        return overlong_filtered_mask(response_mask, truncated)

    def advantages(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                   per_function_scores=None):
        """Advantages, float32 Paddle tensor [B, T] (zero outside the mask)."""
        return self.advantages_and_metrics(scores, response_mask, group_ids, old_logp, ref_logp,
                                           per_function_scores)[0]

    def advantages_and_metrics(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                               per_function_scores=None):
        """(advantages, metrics). With kl_coeff > 0 the metrics hold reward_kl, the global mean over
        sequences of each sequence's token-mean KL(old || ref), and reward_kl_num_seqs: the inputs of
        `update_kl_controller`."""
        cfg = self.config
        mask = to_numpy(response_mask)
        options = dict(eps=self.grpo_eps, scale_rewards=cfg.scale_rewards, norm_adv_by_std=cfg.norm_adv_by_std,
                       old_logp=old_logp, ref_logp=ref_logp, kl_coeff=self.kl_coeff,
                       kl_penalty_kind=cfg.kl_penalty, gamma=cfg.gamma, clip_range_score=cfg.clip_range_score,
                       reduce=self.reduce, per_function_scores=per_function_scores,
                       reward_weights=self._reward_weights())
        adv = ADVANTAGE_ESTIMATORS[self.estimator](scores, mask, group_ids, **options)
        if self.normalize_advantage:
            adv = masked_whiten(adv, mask, reduce=self.reduce)
        values = to_numpy(adv)[mask > 0]
        metrics = {"advantage/mean": float(values.mean()) if values.size else 0.0,
                   "advantage/std": float(values.std()) if values.size else 0.0,
                   "advantage/max": float(values.max()) if values.size else 0.0,
                   "advantage/min": float(values.min()) if values.size else 0.0,
                   "kl_coeff": self.kl_coeff}
        if cfg.kl_coeff > 0:
            kl = reward_kl_per_token(old_logp, ref_logp, mask, cfg.kl_penalty)
            lengths = mask.sum(-1)
            valid = lengths > 0
            per_seq = kl.sum(-1)[valid] / lengths[valid]
            total, count = global_sum([per_seq.sum(), float(valid.sum())], self.reduce)
            metrics["reward_kl"] = float(total / count) if count else 0.0
            metrics["reward_kl_num_seqs"] = float(count)
        return adv, metrics

    def update_kl_controller(self, observed_kl: float, n_steps: int) -> float:
        """Adaptive KL: coeff *= 1 + clip(observed/target - 1, -0.2, 0.2) * n_steps / kl_horizon.
        Call once per RL step after `advantages` (observed_kl = metrics['reward_kl'], n_steps = sequences in
        the global batch); a no-op without adaptive_kl. Returns the coefficient for the next step."""
        return self.kl_controller.update(observed_kl, n_steps)

    def _reward_weights(self):
        names = list(getattr(self.config, "reward_funcs", []) or [])
        weights = list(getattr(self.config, "reward_weights", []) or [])
        return {n: float(w) for n, w in zip(names, weights)} if weights else {}

    # --- update side -------------------------------------------------------------------------
    @staticmethod
    def loss_normalizers(response_mask):
        """(tokens, sequences) of a micro-batch's update mask; sum over the mini-batch and ranks for `loss`."""
        return loss_normalizers(response_mask)

    def loss(self, logp, old_logp, ref_logp, advantages, response_mask, entropy, num_tokens, num_seqs) -> LossOutput:
        """This micro-batch's share of the mini-batch loss:
        aggregate(pg_loss_coeff * pg + kl_loss_coeff * kl(logp, ref) - entropy_coeff * entropy).

        num_tokens / num_seqs: mini-batch totals over all micro-batches and data-parallel ranks. The sum of
        the returned losses over the micro-batches and ranks is the mini-batch loss; when the gradient sync
        averages over ranks instead of summing, scale the loss by the world size.
        """
        cfg = self.config
        logp = as_tensor(logp)
        mask = as_tensor(response_mask, like=logp)
        pg, metrics = policy_loss_tensors(cfg.policy_loss, logp, old_logp, advantages, mask,
                                           clip_low=self.clip_low, clip_high=self.clip_high,
                                           clip_ratio_c=cfg.clip_ratio_c, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)
        total = cfg.pg_loss_coeff * pg
        with paddle.no_grad():
            metrics["pg_loss"] = masked_mean(pg, mask)
        if self.kl_loss_coeff > 0:
            if ref_logp is None:
                raise ValueError("kl_loss_coeff > 0 needs ref_logp")
            kl = kl_penalty(logp, as_tensor(ref_logp, like=logp), cfg.kl_loss_type)
            total = total + self.kl_loss_coeff * kl
            with paddle.no_grad():
                metrics["kl_loss"] = masked_mean(kl, mask)
        if entropy is not None:
            entropy = as_tensor(entropy, like=logp)
            if cfg.entropy_coeff:
                total = total - cfg.entropy_coeff * entropy
            with paddle.no_grad():
                metrics["entropy"] = masked_mean(entropy, mask)
        elif cfg.entropy_coeff:
            raise ValueError("entropy_coeff > 0 needs the per-token entropy")
        loss = aggregate_loss(total, mask, self.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                              loss_scale_factor=self.loss_scale_factor)
        out = metrics_to_floats(metrics)
        out["kl_coeff"] = self.kl_coeff
        return LossOutput(loss, out, float(to_numpy(mask).sum()))

    # --- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Running statistics (JSON-serializable): reward moments and the KL coefficient."""
        return {"reward_moments": self.reward_moments.state_dict(), "kl_coeff": float(self.kl_controller.value)}

    def set_state_dict(self, state: dict) -> None:
        if not state:
            return
        if "reward_moments" in state:
            self.reward_moments.set_state_dict(state["reward_moments"])
        if "kl_coeff" in state:
            self.kl_controller.value = float(state["kl_coeff"])
