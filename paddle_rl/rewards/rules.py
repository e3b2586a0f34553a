"""Registry of in-process rule rewards: name -> fn(samples) -> (scores [B], correct [B] bool or None)."""
from typing import Callable, Dict, List

import numpy as np

from .base import RewardSample
from .kk import CORRECT_SCORE, kk_score

RULE_REWARDS: Dict[str, Callable] = {}


def register_rule(name):
    def wrap(fn):
        RULE_REWARDS[name] = fn
        return fn
    return wrap


@register_rule("kk")
def kk_rule(samples: List[RewardSample]):
    scores = np.array([kk_score(s.response, str(s.ground_truth)) for s in samples], dtype=np.float32)
    return scores, scores >= CORRECT_SCORE
