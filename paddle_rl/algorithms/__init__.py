"""Advantage estimators, KL estimators, policy losses and loss aggregation: registries of pure functions,
and `Objective`, the one object the trainer uses."""
from .advantages import ADVANTAGE_ESTIMATORS
from .aggregation import LOSS_AGG_MODES, aggregate_loss, loss_normalizers
from .dapo import overlong_filtered_mask, select_groups, soft_overlong_penalty, zero_variance_groups
from .kl import KL_ESTIMATORS, AdaptiveKLController, kl_penalty
from .losses import POLICY_LOSSES, policy_loss
from .objective import LossOutput, Objective, check_names
from .stats import RunningMoments, masked_whiten


def compute_advantages(name, scores, response_mask, group_ids, **options):
    """Advantages [B, T] (float32 Paddle tensor) of the named estimator.

    scores [B]; response_mask [B, T]; group_ids [B] (any hashable ids). Options: the ones the estimator
    declares (ADVANTAGE_ESTIMATORS[name].options; any other is a TypeError), named as the config keys: grpo_eps,
    scale_rewards (group|batch|none), norm_adv_by_std (grpo); old_logp, ref_logp, kl_coeff, kl_penalty (reward
    KL, all); gamma, clip_range_score (REINFORCE++, gae); lam, whiten_advantages (gae); per_function_scores (NaN:
    not applicable), reward_weights (gdpo); reduce (batch statistics across ranks: None = this call holds the
    whole batch, or a group).
    """
    return ADVANTAGE_ESTIMATORS.lookup(name)(scores, response_mask, group_ids, **options)


__all__ = ["compute_advantages", "kl_penalty", "policy_loss", "aggregate_loss", "loss_normalizers", "masked_whiten",
           "Objective", "LossOutput", "check_names", "AdaptiveKLController", "RunningMoments", "soft_overlong_penalty",
           "zero_variance_groups", "overlong_filtered_mask", "select_groups",
           "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "LOSS_AGG_MODES"]
