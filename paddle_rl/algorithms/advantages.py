"""Advantage estimators: scores [B] (+ token data [B, T]) -> advantages, float32 Paddle tensor [B, T].

Each estimator is a pure function registered by name with the options it reads (registry.py); it is called
with those options only. The configuration keys an estimator reads are declared here, beside it (`option`: the
PaddleNLP key, type, default, help, check, the rule for its value when unset), and its parameters carry the keys'
names. Statistics are computed in float64. Group statistics need every response of a
group in the call (shard data-parallel ranks by prompt); batch-wide statistics (scale_rewards=batch, the
REINFORCE++ whitening, gdpo's batch z-score) are summed over ranks through the `reduce` option (stats.py;
None: this call holds the whole batch).
"""
from typing import Optional

import numpy as np
import paddle

from ..config.algorithm_args import preset_value
from ..config.fields import at_least, one_of, within
from ..config.options import option
from ._tensor import to_numpy
from .kl import kl_penalty as kl_estimate
from .registry import Registry
from .stats import global_mean_var, masked_whiten

# (scores, response_mask, group_ids); the inputs the Objective gives: the step's log-probs, the reward KL
# coefficient in effect, per-function scores, the critic's values (each call); the batch group, the reward weights
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", positional=3,
                                inputs=("old_logp", "ref_logp", "kl_coeff", "per_function_scores", "values", "reduce",
                                        "reward_weights"))
SCALE_REWARDS = ("group", "batch", "none")

# --- keys read by several estimators ----------------------------------------------------------
KL_PENALTY = option("kl_penalty", str, "kl", "Estimator of the reward KL (names: docs/algorithms.md).")
GRPO_EPS = option("grpo_eps", Optional[float], None, "Epsilon added to the std in GRPO-family estimators "
                  "(default from algorithm_preset: 1e-6, trl 1e-4).", check=at_least(0),
                  when_unset=lambda config: preset_value(config, "grpo_eps"))
GAMMA = option("gamma", float, 1.0, "Discount of the REINFORCE++ token return and of GAE (rl_algorithm ppo).",
               check=within(0, 1))
CLIP_RANGE_SCORE = option("clip_range_score", float, 10.0, "Scores are clipped to [-clip_range_score, "
                          "clip_range_score].", check=at_least(0))

# The reward KL (kl_coeff > 0) every estimator folds in: rollout vs reference log-probs, coefficient, estimator.
REWARD_KL_OPTIONS = ("old_logp", "ref_logp", "kl_coeff", KL_PENALTY)


def register_advantage(name, options=(), **traits):
    """Register an estimator `fn(scores, response_mask, group_ids, *, <options>)`; traits: loss_agg_mode (the
    aggregation it defaults to when loss_agg_mode is unset)."""
    return ADVANTAGE_ESTIMATORS.register(name, options, **traits)


# --- helpers ----------------------------------------------------------------------------------

def group_index(group_ids):
    """Group ids of any hashable kind -> dense int64 index [B] and the number of groups."""
    ids = to_numpy(group_ids, dtype=None)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    _, dense = np.unique(ids, return_inverse=True)
    return dense.reshape(-1).astype(np.int64), int(dense.max()) + 1


def group_mean_std(scores, group_ids, ddof: int = 1):
    """Per-sample mean and std (ddof 1: unbiased) of its group; a group of one gets mean 0, std 1."""
    dense, n_groups = group_index(group_ids)
    s = to_numpy(scores)
    mean, std = np.zeros_like(s), np.ones_like(s)
    for g in range(n_groups):
        idx = dense == g
        if idx.sum() > 1:
            mean[idx] = s[idx].mean()
            std[idx] = s[idx].std(ddof=ddof)
    return mean, std


def broadcast(per_sample, response_mask):
    """[B] -> float32 tensor [B, T], zero outside the mask."""
    m = to_numpy(response_mask)
    values = np.where(m > 0, np.asarray(per_sample, np.float64)[:, None], 0.0)
    return paddle.to_tensor(values.astype(np.float32))


def reward_kl_per_token(old_logp, ref_logp, response_mask, kind: str = "kl"):
    """KL(old || ref) estimate on each response token, float64 numpy [B, T] (zero outside the mask)."""
    if old_logp is None or ref_logp is None:
        raise ValueError("kl_coeff > 0 needs old_logp and ref_logp (the reward KL compares rollout and reference)")
    kl = to_numpy(kl_estimate(paddle.to_tensor(to_numpy(old_logp)), paddle.to_tensor(to_numpy(ref_logp)), kind))
    return kl * to_numpy(response_mask)


def reward_kl_penalty(response_mask, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                      kl_penalty: str = "kl"):
    """kl_coeff * sum_t kl_t per sequence, float64 numpy [B] (zeros without kl_coeff)."""
    if not kl_coeff:
        return np.zeros(to_numpy(response_mask).shape[0], dtype=np.float64)
    return kl_coeff * reward_kl_per_token(old_logp, ref_logp, response_mask, kl_penalty).sum(-1)


def outcome_scores(scores, response_mask, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                   kl_penalty: str = "kl"):
    """Sequence scores with the reward KL folded in: s_i - kl_coeff * sum_t kl_t (outcome estimators)."""
    s = to_numpy(scores)
    if kl_coeff:
        s = s - reward_kl_penalty(response_mask, old_logp, ref_logp, kl_coeff, kl_penalty)
    return s


def equal_score_groups(scores, group_ids) -> np.ndarray:
    """Per sample [B] bool: its group has two or more responses and their scores are all exactly equal (no
    outcome signal to normalize)."""
    dense, n_groups = group_index(group_ids)
    s = to_numpy(scores).reshape(-1)
    flat = np.zeros(s.shape[0], dtype=bool)
    for g in range(n_groups):
        idx = dense == g
        if idx.sum() > 1 and s[idx].max() == s[idx].min():
            flat[idx] = True
    return flat


def last_token_index(mask: np.ndarray) -> np.ndarray:
    """Index of the last response token of each row (0 for an empty row)."""
    length = mask.shape[1]
    return length - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)


def discounted_returns(token_rewards, mask, gamma: float = 1.0) -> np.ndarray:
    """G_t = r_t + gamma * G_{t+1} over the masked tokens, reset outside the mask. float64 [B, T]."""
    r, m = to_numpy(token_rewards), to_numpy(mask)
    out = np.zeros_like(r)
    running = np.zeros(r.shape[0], dtype=np.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        running = (r[:, t] + gamma * running) * m[:, t]
        out[:, t] = running
    return out


# --- outcome estimators -----------------------------------------------------------------------

def _std_against_batch(key, value, config):
    if not value and config.scale_rewards == "batch":
        return f"{key}: false contradicts scale_rewards: batch (use scale_rewards: none)"
    return None


@register_advantage("grpo", (
        GRPO_EPS,
        option("scale_rewards", str, "group", "GRPO std: group (group std) | batch (batch std) | none (no division).",
               check=one_of(SCALE_REWARDS)),
        option("norm_adv_by_std", bool, True, "GRPO divides by the std (false: Dr.GRPO-style, like scale_rewards: "
               "none).", check=_std_against_batch),
        "reduce") + REWARD_KL_OPTIONS)
def grpo_advantages(scores, response_mask, group_ids, grpo_eps: float = 1e-6, scale_rewards: str = "group",
                    norm_adv_by_std: bool = True, reduce=None, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                    kl_penalty: str = "kl"):
    """(s - group mean) / (std + grpo_eps); std of the group (scale_rewards=group), of the whole batch (batch),
    or no division (none, or norm_adv_by_std=False).

    With the reward KL (kl_coeff) a group whose scores are all equal has no outcome signal, and its std would be
    the KL's alone (rounding-sized where the policy still equals the reference, which the division blows up to
    advantages of unit size): such a group gets the centered penalty -(p_i - mean_g p), p_i = kl_coeff * sum_t
    kl_t, divided by nothing (zero without kl_coeff)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    raw = to_numpy(scores)
    penalty = reward_kl_penalty(response_mask, old_logp, ref_logp, kl_coeff, kl_penalty)
    s = raw - penalty
    mean, std = group_mean_std(s, group_ids)
    if not norm_adv_by_std or scale_rewards == "none":
        adv = s - mean
    else:
        if scale_rewards == "batch":
            _, var = global_mean_var(s, reduce=reduce)
            std = np.full_like(s, np.sqrt(var))
        adv = (s - mean) / (std + grpo_eps)
    flat = equal_score_groups(raw, group_ids)
    if flat.any():
        penalty_mean, _ = group_mean_std(penalty, group_ids)
        adv = np.where(flat, penalty_mean - penalty, adv)
    return broadcast(adv, response_mask)


@register_advantage("dr_grpo", REWARD_KL_OPTIONS, loss_agg_mode="seq-mean-token-sum-norm")
def dr_grpo_advantages(scores, response_mask, group_ids, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                       kl_penalty: str = "kl"):
    """s - group mean (no std division; pairs with loss_agg_mode seq-mean-token-sum-norm, its default)."""
    s = outcome_scores(scores, response_mask, old_logp, ref_logp, kl_coeff, kl_penalty)
    mean, _ = group_mean_std(s, group_ids)
    return broadcast(s - mean, response_mask)


@register_advantage("rloo", REWARD_KL_OPTIONS)
def rloo_advantages(scores, response_mask, group_ids, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                    kl_penalty: str = "kl"):
    """s_i - mean of the other G-1 scores of the group = G/(G-1) (s_i - mean); a group of one keeps s_i."""
    s = outcome_scores(scores, response_mask, old_logp, ref_logp, kl_coeff, kl_penalty)
    dense, n_groups = group_index(group_ids)
    adv = s.copy()
    for g in range(n_groups):
        idx = dense == g
        n = int(idx.sum())
        if n > 1:
            adv[idx] = (s[idx] * n - s[idx].sum()) / (n - 1)
    return broadcast(adv, response_mask)


def applicable_group_zscore(values, group_ids, eps: float = 1e-6) -> np.ndarray:
    """(v - group mean) / (group std + eps) over the entries that are not NaN; NaN entries ("not applicable")
    are left out of their group's statistics and get 0. The applicable entries of a group follow the group
    rules (unbiased std; a single applicable entry has mean 0, std 1)."""
    v = to_numpy(values).reshape(-1)
    ids = to_numpy(group_ids, dtype=None).reshape(-1)
    applicable = ~np.isnan(v)
    out = np.zeros_like(v)
    if applicable.any():
        mean, std = group_mean_std(v[applicable], ids[applicable])
        out[applicable] = (v[applicable] - mean) / (std + eps)
    return out


@register_advantage("gdpo", ("per_function_scores", "reward_weights", GRPO_EPS, "reduce") + REWARD_KL_OPTIONS)
def gdpo_advantages(scores, response_mask, group_ids, per_function_scores=None, reward_weights=None,
                    grpo_eps: float = 1e-6, reduce=None, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                    kl_penalty: str = "kl"):
    """Each reward function z-scored within its group, weighted sum, then z-scored over the batch.

    per_function_scores: {name: [B]}, NaN where a function does not apply to a sample: that sample is left
    out of the function's group statistics and gets 0 from it. reward_weights: {name: weight} (default 1).
    Without per-function scores the total score is the only function. The reward KL (kl_coeff) lowers the
    summed score.
    """
    functions = per_function_scores or {"score": scores}
    weights = reward_weights or {}
    total = np.zeros(len(to_numpy(scores)), dtype=np.float64)
    for name, values in functions.items():
        total += float(weights.get(name, 1.0)) * applicable_group_zscore(values, group_ids, grpo_eps)
    total = outcome_scores(total, response_mask, old_logp, ref_logp, kl_coeff, kl_penalty)
    mean, var = global_mean_var(total, reduce=reduce)
    return broadcast((total - mean) / (np.sqrt(var) + grpo_eps), response_mask)


# --- token-level estimators -------------------------------------------------------------------

def token_rewards(scores, response_mask, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                  kl_penalty: str = "kl", clip_range_score: float = 10.0) -> np.ndarray:
    """Per-token rewards, float64 [B, T]: -kl_coeff * KL(old || ref) on every token of the mask, plus the clipped
    score on the last token of the mask (zero elsewhere)."""
    m = to_numpy(response_mask)
    rewards = np.zeros_like(m)
    if kl_coeff:
        rewards -= kl_coeff * reward_kl_per_token(old_logp, ref_logp, m, kl_penalty)
    s = np.clip(to_numpy(scores), -clip_range_score, clip_range_score)
    has_tokens = m.sum(-1) > 0
    rows = np.arange(m.shape[0])[has_tokens]
    rewards[rows, last_token_index(m)[has_tokens]] += s[has_tokens]
    return rewards


def reinforce_returns(scores, response_mask, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                      kl_penalty: str = "kl", gamma: float = 1.0, clip_range_score: float = 10.0):
    """Token rewards (-kl_coeff * KL on every token, clipped score on the last) -> discounted returns."""
    rewards = token_rewards(scores, response_mask, old_logp, ref_logp, kl_coeff, kl_penalty, clip_range_score)
    return discounted_returns(rewards, to_numpy(response_mask), gamma)


def generalized_advantages(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """GAE over the tokens of the mask: (advantages, returns), float64 [B, T], zero outside the mask.

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, R_t = A_t + V_t, where "next" is the
    next token of the mask in the same row (V after the last one = 0). Tokens outside the mask (padding, or a
    multi-turn episode's observation tokens inside a response) are not steps of the recursion: they get 0 and
    the recursion passes over them, so an observation between two turns is part of the environment's transition
    from the last token of one turn to the first of the next (one discount step, its reward and value unused)."""
    r, v, m = to_numpy(rewards), to_numpy(values), to_numpy(mask) > 0
    adv = np.zeros_like(r)
    next_value = np.zeros(r.shape[0], dtype=np.float64)
    running = np.zeros(r.shape[0], dtype=np.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        on = m[:, t]
        current = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * running
        adv[:, t] = np.where(on, current, 0.0)
        running = np.where(on, current, running)
        next_value = np.where(on, v[:, t], next_value)
    return adv, np.where(m, adv + v, 0.0)


REINFORCE_OPTIONS = REWARD_KL_OPTIONS + (GAMMA, CLIP_RANGE_SCORE, "reduce")


@register_advantage("reinforce_plus_plus", REINFORCE_OPTIONS)
def reinforce_pp_advantages(scores, response_mask, group_ids=None, old_logp=None, ref_logp=None,
                            kl_coeff: float = 0.0, kl_penalty: str = "kl", gamma: float = 1.0,
                            clip_range_score: float = 10.0, reduce=None):
    """REINFORCE++: token returns whitened over every valid token of the global batch."""
    returns = reinforce_returns(scores, response_mask, old_logp, ref_logp, kl_coeff, kl_penalty, gamma,
                                clip_range_score)
    return paddle.to_tensor(masked_whiten(returns, to_numpy(response_mask), reduce=reduce).astype(np.float32))


@register_advantage("reinforce_plus_plus_baseline", REINFORCE_OPTIONS)
def reinforce_pp_baseline_advantages(scores, response_mask, group_ids, old_logp=None, ref_logp=None,
                                     kl_coeff: float = 0.0, kl_penalty: str = "kl", gamma: float = 1.0,
                                     clip_range_score: float = 10.0, reduce=None):
    """REINFORCE++ with the group mean subtracted from the scores first."""
    clipped = np.clip(to_numpy(scores), -clip_range_score, clip_range_score)
    mean, _ = group_mean_std(clipped, group_ids)
    return reinforce_pp_advantages(clipped - mean, response_mask, None, old_logp=old_logp, ref_logp=ref_logp,
                                   kl_coeff=kl_coeff, kl_penalty=kl_penalty, gamma=gamma,
                                   clip_range_score=np.inf, reduce=reduce)


# --- estimators with a critic -----------------------------------------------------------------

@register_advantage("gae", REWARD_KL_OPTIONS + (
        "values", GAMMA,
        option("lam", float, 1.0, "GAE lambda (rl_algorithm ppo / advantage_estimator gae; verl's algorithm.lam).",
               aliases=("gae_lambda",), check=within(0, 1)),
        CLIP_RANGE_SCORE,
        option("whiten_advantages", bool, True, "GAE: whiten the advantages over every response token of the global "
               "batch (masked mean / std)."),
        "reduce"), critic=True)
def gae_advantages(scores, response_mask, group_ids=None, values=None, old_logp=None, ref_logp=None,
                   kl_coeff: float = 0.0, kl_penalty: str = "kl", gamma: float = 1.0, lam: float = 1.0,
                   clip_range_score: float = 10.0, whiten_advantages: bool = True, reduce=None):
    """PPO with a critic: token rewards (-kl_coeff * KL on every token, clipped score on the last), GAE against
    the critic's rollout-time `values` [B, T]. Returns (advantages as a float32 Paddle tensor, whitened over every
    token of the global batch when `whiten_advantages`; returns R = A + V before whitening, float64 numpy: the critic's
    targets). The trait critic=True tells the Objective that this estimator needs values and gives returns."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values of the rollout")
    m = to_numpy(response_mask)
    rewards = token_rewards(scores, m, old_logp, ref_logp, kl_coeff, kl_penalty, clip_range_score)
    adv, returns = generalized_advantages(rewards, to_numpy(values) * m, m, gamma, lam)
    if whiten_advantages:
        adv = masked_whiten(adv, m, reduce=reduce)
    return paddle.to_tensor(adv.astype(np.float32)), returns
