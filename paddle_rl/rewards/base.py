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
        nested = rec.get("reward_model")
        if isinstance(nested, dict) and nested.get("ground_truth") is not None:
            return nested["ground_truth"]
        return None

    @property
    def data_source(self) -> Optional[str]:
        value = self.record.get("data_source")
        return None if value is None else str(value)


@dataclass
class RewardResult:
    """Scores of a batch.

    scores:       [B] float32, weighted sum of the reward functions. NaN exactly where `skipped` is True.
    per_function: name -> [B] float32, each function's unweighted score; NaN where that function did not
                  apply to the sample (routed elsewhere by data_source, or returned None) or it was skipped.
    correct:      [B] bool where the task defines correctness (kk, math, gsm8k), else None.
    skipped:      [B] bool, or None when nothing was skipped. True marks a sample the reward server could not
                  score under `reward_server_on_failure: skip`; such samples carry no training signal and must be
                  dropped by the caller (metrics() counts them as reward/skipped).
    outcomes:     "<function>/<outcome>" -> [B] float32 counts per sample (e.g. code/timeout: the sample's test
                  runs that timed out), from functions that report them; metrics() sums them over the batch.
    """
    scores: np.ndarray
    per_function: Dict[str, np.ndarray] = field(default_factory=dict)
    correct: Optional[np.ndarray] = None
    skipped: Optional[np.ndarray] = None
    outcomes: Dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def kept(self) -> np.ndarray:
        """[B] bool: samples that were scored."""
        if self.skipped is None:
            return np.ones(len(self.scores), dtype=bool)
        return ~np.asarray(self.skipped, dtype=bool)

    def metrics(self, prefix: str = "reward") -> dict:
        kept = self.kept
        scores = np.asarray(self.scores, dtype=np.float64)[kept]
        out = {
            f"{prefix}/mean": float(scores.mean()) if scores.size else float("nan"),
            f"{prefix}/std": float(scores.std()) if scores.size else float("nan"),
        }
        for name, values in self.per_function.items():
            values = np.asarray(values, dtype=np.float64)[kept]
            values = values[~np.isnan(values)]
            out[f"{prefix}/{name}_mean"] = float(values.mean()) if values.size else float("nan")
        for name, counts in self.outcomes.items():
            out[f"{prefix}/{name}"] = float(np.asarray(counts, dtype=np.float64)[kept].sum())
        if self.skipped is not None:
            out[f"{prefix}/skipped"] = float(np.asarray(self.skipped, dtype=bool).sum())
        if self.correct is not None:
            correct = np.asarray(self.correct, dtype=bool)[kept]
            out[f"{prefix}/accuracy"] = float(correct.mean()) if correct.size else float("nan")
        return out


def concat_results(parts: List[RewardResult]) -> RewardResult:
    if not parts:
        return RewardResult(np.zeros(0, dtype=np.float32))
    scores = np.concatenate([np.asarray(p.scores, dtype=np.float32) for p in parts])
    names = []
    for p in parts:
        names += [n for n in p.per_function if n not in names]
    per = {n: np.concatenate([np.asarray(p.per_function[n], dtype=np.float32) if n in p.per_function
                              else np.full(len(p.scores), np.nan, dtype=np.float32) for p in parts])
           for n in names}
    correct = None
    if any(p.correct is not None for p in parts):
        correct = np.concatenate([np.asarray(p.correct, dtype=bool) if p.correct is not None
                                  else np.zeros(len(p.scores), dtype=bool) for p in parts])
    skipped = None
    if any(p.skipped is not None for p in parts):
        skipped = np.concatenate([np.asarray(p.skipped, dtype=bool) if p.skipped is not None
                                  else np.zeros(len(p.scores), dtype=bool) for p in parts])
    keys = list(dict.fromkeys(k for p in parts for k in p.outcomes))
    outcomes = {k: np.concatenate([np.asarray(p.outcomes[k], dtype=np.float32) if k in p.outcomes
                                   else np.zeros(len(p.scores), dtype=np.float32) for p in parts]) for k in keys}
    return RewardResult(scores, per, correct, skipped, outcomes)
