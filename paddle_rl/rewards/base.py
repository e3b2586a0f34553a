"""What a reward sees and returns."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np


@dataclass
class RewardSample:
    prompt: str                 # the prompt text as the model saw it (chat-templated)
    response: str               # decoded response, special tokens kept
    record: dict                # the dataset record (ground truth under "tgt"/"solution", data_source, extras)
    response_length: int = 0    # tokens
    truncated: bool = False     # hit max_dec_len without EOS

    @property
    def ground_truth(self):
        rec = self.record
        for key in ("ground_truth", "tgt", "solution"):
            if key in rec and rec[key] is not None:
                return rec[key]
        return None


@dataclass
class RewardResult:
    scores: np.ndarray                                   # [B] weighted sum of the reward functions
    per_function: Dict[str, np.ndarray] = field(default_factory=dict)
    correct: Optional[np.ndarray] = None                 # [B] bool where the task defines correctness

    def metrics(self, prefix: str = "reward") -> dict:
        out = {f"{prefix}/mean": float(self.scores.mean()), f"{prefix}/std": float(self.scores.std())}
        for name, values in self.per_function.items():
            out[f"{prefix}/{name}_mean"] = float(values.mean())
        if self.correct is not None:
            out["accuracy"] = float(self.correct.mean())
        return out


def concat_results(parts: List[RewardResult]) -> RewardResult:
    scores = np.concatenate([p.scores for p in parts])
    names = parts[0].per_function.keys() if parts else []
    per = {n: np.concatenate([p.per_function[n] for p in parts]) for n in names}
    correct = None if any(p.correct is None for p in parts) else np.concatenate([p.correct for p in parts])
    return RewardResult(scores, per, correct)
