"""Advantage estimators, KL estimators, policy losses and loss aggregation: registries of pure functions."""
from .advantages import ADVANTAGE_ESTIMATORS, masked_whiten
from .aggregation import aggregate_loss
from .kl import KL_ESTIMATORS, kl_penalty
from .losses import POLICY_LOSSES, policy_loss
from .objective import LossOutput, Objective


def compute_advantages(name, scores, response_mask, group_ids, **options):
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r} (choose from {', '.join(ADVANTAGE_ESTIMATORS)})")
    return ADVANTAGE_ESTIMATORS[name](scores, response_mask, group_ids, **options)


__all__ = ["compute_advantages", "kl_penalty", "policy_loss", "aggregate_loss", "masked_whiten", "Objective",
           "LossOutput", "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES"]
