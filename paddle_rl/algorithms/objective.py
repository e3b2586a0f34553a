"""The RL objective chosen by a config: score shaping, advantages, the per-micro-batch loss, DAPO filters.

The trainer talks only to `Objective`; the math lives in the registries of advantages.py, kl.py,
losses.py and aggregation.py (registry.py), and the DAPO pieces in dapo.py. Building an Objective checks
every configured name against those registries (a ConfigError naming the key, the value and the
choices), before any model loads, and binds each registered function's declared options once: each key it
declares as `{key: value in effect}` (the key's own default rule fills in a null), the Objective's inputs by name.

Data-parallel contract: every call sees this rank's shard of the batch, with every response of a
prompt group on the same rank. Batch-wide statistics (REINFORCE++ whitening, scale_rewards=batch,
gdpo, normalize_advantage, normalize_reward's running moments, the KL metrics and the adaptive KL
controller's sequence count) are summed over ranks through `reduce`, which the caller always passes:
the batch group (data x sharding ranks), or None when this process holds the whole batch (stats.py).
"""
import logging
from dataclasses import dataclass

import numpy as np
import paddle

from ..config import ConfigError
from ..config.options import PIECE_OPTIONS
from ._tensor import as_tensor, metrics_to_floats, to_numpy
from .advantages import ADVANTAGE_ESTIMATORS, GRPO_EPS, reward_kl_per_token
from .aggregation import LOSS_AGG_MODES, LOSS_SCALE_FACTOR, aggregate_loss, loss_normalizers
from .correction import GAP_METRICS, SUMMED, correction_metrics, rollout_correction
from .dapo import overlong_filtered_mask, select_groups, soft_overlong_penalty, zero_variance_groups
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .losses import CLIP_OPTIONS, POLICY_LOSSES, masked_mean, policy_loss_tensors
from .stats import RunningMoments, global_sum, masked_whiten
from .value import clipped_value_loss, value_statistics

logger = logging.getLogger("paddle_rl")

REWARD_NORM_EPS = 1e-8
# Estimator inputs that change with every call (the step's data and the current reward KL coefficient); the
# other inputs (reduce, reward_weights) and every declared key are bound once.
STEP_INPUTS = ("old_logp", "ref_logp", "per_function_scores", "kl_coeff", "values")


def check_names(config) -> None:
    """Every name the config chooses must be registered: raise ConfigError naming the key, the bad value
    and the choices (one line per bad key). The registries are the only list of valid names."""
    estimator_key = "rl_algorithm" if config.advantage_estimator is None else "advantage_estimator"
    checks = [(estimator_key, config.resolved_estimator, ADVANTAGE_ESTIMATORS),
              ("policy_loss", config.policy_loss, POLICY_LOSSES),
              ("kl_penalty", config.kl_penalty, KL_ESTIMATORS),
              ("kl_loss_type", config.kl_loss_type, KL_ESTIMATORS),
              ("loss_agg_mode", config.loss_agg_mode, LOSS_AGG_MODES)]
    problems = [f"{key}: {value!r} is not one of {registry.choices}" for key, value, registry in checks
                if value is not None and value not in registry]
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


@dataclass
class LossOutput:
    loss: paddle.Tensor   # this micro-batch's share of the mini-batch loss (sum over micro-batches = total)
    metrics: dict         # token means over this micro-batch (python floats); weight them by num_tokens
    num_tokens: float     # response tokens of this micro-batch


class Objective:
    """Everything the trainer needs from the algorithm side, configured by the `algorithm` keys.

    reduce: who else holds part of the batch; always explicit: the batch group, or None when this process
    holds the whole batch (a callable summing a float64 vector over ranks also works; tests use it).
    """

    def __init__(self, config, reduce):
        check_names(config)
        self.config = config
        self.reduce = reduce
        self.estimator = config.resolved_estimator
        self._estimator = ADVANTAGE_ESTIMATORS[self.estimator]
        self._policy_loss = POLICY_LOSSES[config.policy_loss]
        self.loss_agg_mode = (config.loss_agg_mode or self._estimator.traits.get("loss_agg_mode")
                              or self._policy_loss.traits.get("loss_agg_mode") or config.preset_loss_agg_mode)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ConfigError(f"algorithm_preset: its loss_agg_mode {self.loss_agg_mode!r} is not one of "
                              f"{LOSS_AGG_MODES.choices}")
        self.loss_scale_factor = LOSS_SCALE_FACTOR.value(config)
        self.grpo_eps = GRPO_EPS.value(config)
        self.kl_loss_coeff = config.loss_kl_coeff
        self.normalize_reward, self.normalize_advantage = config.score_normalization
        self.kl_controller = (AdaptiveKLController(config.kl_coeff, config.kl_target, config.kl_horizon)
                              if config.adaptive_kl else FixedKLController(config.kl_coeff))
        self.reward_moments = RunningMoments()
        # the declared keys of each chosen piece, each resolved once; the estimator's inputs by name
        inputs = {"reduce": reduce, "reward_weights": self._reward_weights()}
        self._estimator_options = self._estimator.bind(config, inputs, STEP_INPUTS)
        self._loss_options = self._policy_loss.bind(config, {})
        self._check_unread((self._estimator, self._policy_loss, LOSS_AGG_MODES[self.loss_agg_mode]))
        self._warn_ignored()

    def _check_unread(self, chosen):
        """A key declared `error_when_unread` (its null means off) set while none of the chosen pieces reads it."""
        for declared in PIECE_OPTIONS:
            if not declared.error_when_unread or getattr(self.config, declared.key) is None:
                continue
            if any(declared in entry.keys for entry in chosen):
                continue
            what = PIECE_OPTIONS.readers(declared.key)[0][0]   # the registry whose pieces read it
            names = ", ".join(name for w, name in PIECE_OPTIONS.readers(declared.key) if w == what)
            instead = next(entry.name for entry in chosen if entry.what == what)
            raise ConfigError(f"{declared.key}: read by {what} {names} only (its registered options), not by "
                              f"{instead!r}")

    def _warn_ignored(self):
        cfg = self.config
        if cfg.kl_loss_coeff > 0 and self.kl_loss_coeff == 0:
            logger.warning("kl_loss_coeff: not applied with rl_algorithm reinforce_plus_plus (KL enters the reward "
                           "through kl_coeff); set advantage_estimator: reinforce_plus_plus to add a loss KL too")
        clip_set = [o.key for o in CLIP_OPTIONS if o in self._policy_loss.keys and getattr(cfg, o.key) is not None]
        if clip_set and cfg.update_iters == 1 and cfg.mini_batch_prompts == cfg.global_batch_size \
                and not cfg.async_rollout:
            logger.warning("%s: set, but each rollout batch makes a single optimizer step (update_iters 1, "
                           "global_mini_batch_size = global_batch_size, no async_rollout): the ratio is 1 up to the "
                           "gap between the rollout's and the trainer's log-probs, so the clip acts on that gap alone "
                           "(actor/clipfrac_* stay 0 with a float32 rollout); update_iters > 1 or smaller mini-batches "
                           "let it act", ", ".join(clip_set))
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
    def uses_critic(self) -> bool:
        """Whether the estimator needs the critic's values (and gives the returns it trains on): gae."""
        return bool(self._estimator.traits.get("critic"))

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
        metrics = {"score/truncated_share": float(truncated.mean()) if truncated.size else 0.0,
                   "score/raw_mean": float(s.mean()) if s.size else 0.0}
        if cfg.enable_overlong_reward_buffer:
            penalty = soft_overlong_penalty(lengths, cfg.max_dec_len, cfg.overlong_reward_buffer,
                                            cfg.overlong_penalty_factor)
            s = s + penalty
            metrics["score/overlong_penalty_mean"] = float(penalty.mean()) if penalty.size else 0.0
        if self.normalize_reward:
            self.reward_moments.update(s, self.reduce)
            s = (s - self.reward_moments.mean) / np.sqrt(self.reward_moments.var + REWARD_NORM_EPS)
            metrics["score/running_mean"] = float(self.reward_moments.mean)
            metrics["score/running_std"] = self.reward_moments.std
        clip = cfg.clip_range_score
        metrics["score/clip_share"] = float((np.abs(s) > clip).mean()) if s.size else 0.0
        s = np.clip(s, -clip, clip)
        metrics["score/shaped_mean"] = float(s.mean()) if s.size else 0.0
        return s.astype(np.float32), metrics

    def filter_groups(self, scores, group_ids):
        """DAPO dynamic sampling: (keep [B] bool, metrics). Groups of two or more whose score variance is
        <= 1e-6 are dropped when dynamic_sampling is on; otherwise everything is kept. The metric
        batch/zero_variance_group_share is reported either way."""
        keep, share = zero_variance_groups(scores, group_ids)
        if not self.config.dynamic_sampling:
            keep = np.ones_like(keep)
        return keep, {"batch/zero_variance_group_share": float(share),
                      "batch/kept_share": float(keep.mean()) if keep.size else 0.0}

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

    def rollout_correction(self, old_logp, rollout_logp, response_mask, greedy=None):
        """(is_weight [B, T], update mask [B, T], metrics) of the rollout correction the config asks for
        (rollout_is, rollout_rs, rollout_token_veto_threshold; algorithms/correction.py), statistics over the whole
        batch (summed through `reduce`; the */max metrics are this rank's, reduce_metrics takes the largest).
        Without those keys the weight is 1 and nothing is rejected, and the metrics are the gap's alone
        (`GAP_METRICS`: the trainer reports them whenever it recomputes the old log-probs). `greedy`: (the
        rollout's argmax, the trainer's) per token, for rollout_corr/greedy_differs."""
        cfg = self.config
        weight, keep, sums = rollout_correction(
            old_logp, rollout_logp, response_mask, is_level=cfg.rollout_is, is_threshold=cfg.rollout_is_threshold,
            rs_level=cfg.rollout_rs, rs_upper=cfg.rollout_rs_threshold, rs_lower=cfg.rollout_rs_threshold_lower,
            veto_threshold=cfg.rollout_token_veto_threshold, greedy=greedy)
        totals = dict(zip(SUMMED, global_sum([sums[k] for k in SUMMED], self.reduce)))
        metrics = correction_metrics(dict(sums, **totals), greedy=greedy is not None)
        if not cfg.rollout_correction:
            metrics = {k: v for k, v in metrics.items() if k in GAP_METRICS}
        return weight, keep, metrics

    def advantages(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                   per_function_scores=None, values=None):
        """Advantages, float32 Paddle tensor [B, T] (zero outside the mask). No side effects."""
        return self.advantages_and_metrics(scores, response_mask, group_ids, old_logp, ref_logp,
                                           per_function_scores, values)[0]

    def advantages_and_metrics(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                               per_function_scores=None, values=None):
        """(advantages, metrics), no side effects. With kl_coeff > 0 the metrics hold actor/reward_kl, the
        global mean over sequences of each sequence's token-mean KL(old || ref), and actor/reward_kl_num_seqs.
        `values`: the critic's (gae)."""
        adv, _, metrics = self._advantages(scores, response_mask, group_ids, old_logp, ref_logp, per_function_scores,
                                           values)
        kl_metrics, _ = self._kl_statistics(to_numpy(response_mask), old_logp, ref_logp, token_kl=False)
        metrics.update(kl_metrics)
        return adv, metrics

    def step_advantages(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                        per_function_scores=None):
        """`step_advantages_and_returns` without the returns: (advantages, metrics)."""
        adv, _, metrics = self.step_advantages_and_returns(scores, response_mask, group_ids, old_logp, ref_logp,
                                                           per_function_scores)
        return adv, metrics

    def step_advantages_and_returns(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                                    per_function_scores=None, values=None):
        """Once per RL step: (advantages, metrics) as `advantages_and_metrics`, and then
        - metrics["actor/ref_kl"]: the token mean of old_logp - ref_logp (k1) over the global batch (when ref_logp is
          given);
        - the reward KL controller moves (adaptive_kl) by this step's reward_kl over the number of sequences
          in the global batch; metrics["actor/reward_kl_coeff"] is the coefficient after the move (the next step's).
        per_function_scores may hold NaN where a reward function does not apply (gdpo leaves those out).
        Every rank of the batch group calls this once per step (it sums over the group).
        `values` [B, T]: the critic's values of the rollout (a critic estimator, `uses_critic`); returns: the
        critic's targets [B, T] (float32 numpy), None for an estimator without a critic."""
        mask = to_numpy(response_mask)
        adv, returns, metrics = self._advantages(scores, mask, group_ids, old_logp, ref_logp, per_function_scores,
                                                 values)
        kl_metrics, num_seqs = self._kl_statistics(mask, old_logp, ref_logp,
                                                   token_kl=old_logp is not None and ref_logp is not None)
        metrics.update(kl_metrics)
        if "actor/reward_kl" in kl_metrics:
            metrics["actor/reward_kl_coeff"] = self.kl_controller.update(kl_metrics["actor/reward_kl"], num_seqs)
        if returns is not None:
            metrics.update(value_statistics(values, returns, mask, self.reduce))
            returns = returns.astype(np.float32)
        return adv, returns, metrics

    def critic_returns(self, scores, response_mask, group_ids, old_logp=None, ref_logp=None, values=None):
        """The critic's targets of some rows alone ([b, T] float32 numpy): what `step_advantages_and_returns` returns
        for them (returns are per row: no whitening, no sums over ranks, no controller move, no metrics)."""
        step = {"old_logp": old_logp, "ref_logp": ref_logp, "kl_coeff": self.kl_coeff, "values": values,
                "whiten_advantages": False, "reduce": None}
        options = dict(self._estimator_options, **{k: step[k] for k in self._estimator.options if k in step})
        _, returns = self._estimator(scores, to_numpy(response_mask), group_ids, **options)
        return returns.astype(np.float32)

    def _advantages(self, scores, response_mask, group_ids, old_logp, ref_logp, per_function_scores, values=None):
        mask = to_numpy(response_mask)
        step = {"old_logp": old_logp, "ref_logp": ref_logp, "per_function_scores": per_function_scores,
                "kl_coeff": self.kl_coeff, "values": values}
        options = dict(self._estimator_options, **{k: step[k] for k in self._estimator.options if k in step})
        adv, returns = self._estimator(scores, mask, group_ids, **options), None
        if self.uses_critic:
            adv, returns = adv
        if self.normalize_advantage:
            adv = masked_whiten(adv, mask, reduce=self.reduce)
        values = to_numpy(adv)[mask > 0]
        metrics = {"advantage/mean": float(values.mean()) if values.size else 0.0,
                   "advantage/std": float(values.std()) if values.size else 0.0,
                   "advantage/max": float(values.max()) if values.size else 0.0,
                   "advantage/min": float(values.min()) if values.size else 0.0,
                   "actor/reward_kl_coeff": self.kl_coeff}
        return adv, returns, metrics

    def _kl_statistics(self, mask, old_logp, ref_logp, token_kl: bool, reward: bool = True):
        """(metrics, global sequence count) from one reduction over the batch group: the reward KL (kl_coeff
        > 0, unless `reward` is off) and, with token_kl, the token mean of old_logp - ref_logp."""
        local = []
        reward = reward and self.config.kl_coeff > 0
        if reward:
            kl = reward_kl_per_token(old_logp, ref_logp, mask, self.config.kl_penalty)
            lengths = mask.sum(-1)
            valid = lengths > 0
            per_seq = kl.sum(-1)[valid] / lengths[valid]
            local += [per_seq.sum(), float(valid.sum()), float(len(mask))]
        if token_kl:
            diff = (to_numpy(old_logp) - to_numpy(ref_logp)) * mask
            local += [diff.sum(), mask.sum()]
        if not local:
            return {}, None
        sums = list(global_sum(local, self.reduce))
        metrics, num_seqs = {}, None
        if reward:
            total, count, num_seqs = sums[:3]
            metrics["actor/reward_kl"] = float(total / count) if count else 0.0
            metrics["actor/reward_kl_num_seqs"] = float(count)
            sums = sums[3:]
        if token_kl:
            total, tokens = sums
            metrics["actor/ref_kl"] = float(total / max(tokens, 1.0))
        return metrics, num_seqs

    def old_policy_kl(self, response_mask, old_logp, ref_logp) -> dict:
        """{"actor/ref_kl": the token mean of old_logp - ref_logp over the global batch} when ref_logp is given (what
        `step_advantages_and_returns` reports, for old log-probs that come after it: the update's own)."""
        if ref_logp is None:
            return {}
        return self._kl_statistics(to_numpy(response_mask), old_logp, ref_logp, token_kl=True, reward=False)[0]

    def update_kl_controller(self, observed_kl: float, n_steps: int) -> float:
        """Adaptive KL: coeff *= 1 + clip(observed/target - 1, -0.2, 0.2) * n_steps / kl_horizon; a no-op without
        adaptive_kl. `step_advantages` calls it (observed_kl = actor/reward_kl, n_steps = sequences in the global
        batch); call it yourself only when not using step_advantages. Returns the coefficient for the next step."""
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

    def loss(self, logp, old_logp, ref_logp, advantages, response_mask, entropy, num_tokens, num_seqs,
             is_weight=None) -> LossOutput:
        """This micro-batch's share of the mini-batch loss:
        aggregate(pg_loss_coeff * w * pg + kl_loss_coeff * kl(logp, ref) - entropy_coeff * entropy), with w the
        rollout correction's per-token IS weight (`rollout_correction`; 1 without it).

        num_tokens / num_seqs: mini-batch totals over all micro-batches and data-parallel ranks. The sum of
        the returned losses over the micro-batches and ranks is the mini-batch loss; when the gradient sync
        averages over ranks instead of summing, scale the loss by the world size.
        """
        cfg = self.config
        logp = as_tensor(logp)
        mask = as_tensor(response_mask, like=logp)
        pg, metrics = policy_loss_tensors(cfg.policy_loss, logp, old_logp, advantages, mask, **self._loss_options)
        if is_weight is not None:
            pg = pg * as_tensor(is_weight, like=logp)
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

    def value_loss(self, values, old_values, returns, response_mask, num_tokens, num_seqs) -> LossOutput:
        """The critic's share of the mini-batch value loss for one micro-batch: clipped_value_loss (clip_range_value)
        aggregated like the policy loss (loss_agg_mode, mini-batch-wide num_tokens / num_seqs)."""
        values = as_tensor(values)
        mask = as_tensor(response_mask, like=values)
        per_token, metrics = clipped_value_loss(values, old_values, returns, mask, self.config.clip_range_value)
        loss = aggregate_loss(per_token, mask, self.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                              loss_scale_factor=self.loss_scale_factor)
        return LossOutput(loss, metrics_to_floats(metrics), float(to_numpy(mask).sum()))

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
