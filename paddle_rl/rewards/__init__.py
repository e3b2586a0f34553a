"""Rewards: rule functions, user plugins and the reward-server client behind one callable."""
from typing import List

import numpy as np

from .base import RewardResult, RewardSample, concat_results
from .rules import RULE_REWARDS, register_rule


class RuleReward:
    """Weighted sum of named rule rewards; `correct` comes from the first function that defines it."""

    def __init__(self, names, weights=None):
        unknown = [n for n in names if n not in RULE_REWARDS]
        if unknown:
            raise ValueError(f"reward_funcs: unknown {unknown} (available: {', '.join(sorted(RULE_REWARDS))})")
        self.names = list(names)
        self.weights = list(weights) if weights else [1.0] * len(self.names)

    def __call__(self, samples: List[RewardSample]) -> RewardResult:
        total = np.zeros(len(samples), dtype=np.float32)
        per, correct = {}, None
        for name, weight in zip(self.names, self.weights):
            scores, is_correct = RULE_REWARDS[name](samples)
            per[name] = scores
            total += weight * scores
            if correct is None and is_correct is not None:
                correct = is_correct
        return RewardResult(total, per, correct)


def build_reward(config):
    """The reward callable a config asks for."""
    return RuleReward(config.reward_funcs, config.reward_weights)


__all__ = ["RewardSample", "RewardResult", "RuleReward", "build_reward", "register_rule", "concat_results",
           "RULE_REWARDS"]
