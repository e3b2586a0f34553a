"""Rollout correction: the gap between the policy that sampled (the rollout's own log-probs) and the policy the
update treats as old (log-probs recomputed by the training forward), as truncated importance sampling (TIS) and
rejection sampling (masked IS, MIS), with verl's key names.

The rollout samples from pi_rollout: in a synchronous run the same weights as the old policy through other
kernels (fused decode against the training forward), in an asynchronous one possibly older weights. With
r_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logp_t - rollout_logp_t) over a response's tokens:

- `rollout_is: token`: each token's policy loss is weighted by min(r_t, rollout_is_threshold);
  `sequence`: every token of a response by min(prod_t r_t, rollout_is_threshold). The weight is a constant of the
  update (no gradient flows through it).
- `rollout_rs` rejects what falls outside [rollout_rs_threshold_lower, rollout_rs_threshold] (defaults:
  rollout_is_threshold, and the reciprocal of the upper bound): `token` a token by r_t, `sequence` a whole response
  by prod_t r_t, `geometric` a whole response by exp(mean_t log r_t). Rejected tokens leave the update's mask
  (policy loss, KL and entropy terms, and the advantages' statistics).
- `rollout_token_veto_threshold`: a response with any r_t below it is rejected whole, whatever the other keys.

Each level is a pure function of (log r [B, T], mask [B, T]) giving the log-ratio each token is judged by
(`LEVELS`); `is` accepts token and sequence, `rs` all three.

`rollout_corr/greedy_differs`: the share of response tokens (the update's mask before any rejection) at which the
greedy choice differs: the argmax over the vocabulary of the rollout's logits there (the rollout engine records it
while sampling, `rollout_greedy`) against the argmax of the trainer's logits at the same position (from the
old-log-prob pass's own chunks of logits). Both are taken before temperature, top-k / top-p, penalties, banned
or forced tokens act, so it measures the two forwards alone; ties go to the lower token id on both sides. Logged
whenever the trainer recomputes the old log-probs of a rollout that recorded its greedy choices.
"""
from typing import Callable, Dict, Optional

import numpy as np

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps a sequence's summed log-ratio finite before thresholds apply


def _token(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return log_ratio


def _sequence(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    total = (log_ratio * mask).sum(-1, keepdims=True)
    return np.broadcast_to(total, log_ratio.shape)


def _geometric(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    tokens = np.maximum(mask.sum(-1, keepdims=True), 1.0)
    return np.broadcast_to((log_ratio * mask).sum(-1, keepdims=True) / tokens, log_ratio.shape)


LEVELS: Dict[str, Callable] = {"token": _token, "sequence": _sequence, "geometric": _geometric}
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def rollout_correction(old_logp, rollout_logp, mask, is_level: Optional[str] = None, is_threshold: float = 2.0,
                       rs_level: Optional[str] = None, rs_upper: Optional[float] = None,
                       rs_lower: Optional[float] = None, veto_threshold: Optional[float] = None,
                       greedy: Optional[tuple] = None):
    """(is_weight [B, T] float32, keep [B, T] float32, sums) for one batch.

    is_weight is 1 where no IS applies and 0 outside the mask; keep is the mask with rejected tokens zeroed. `sums`
    holds this batch's totals for `correction_metrics` (summed over data-parallel ranks before dividing).
    `greedy`: (the rollout's argmax [B, T], the trainer's argmax [B, T]) adds the tokens where they differ."""
    mask = np.asarray(mask, dtype=np.float64)
    log_ratio = np.clip((np.asarray(old_logp, np.float64) - np.asarray(rollout_logp, np.float64)) * mask,
                        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    keep = mask.copy()
    if rs_level is not None:
        upper = is_threshold if rs_upper is None else rs_upper
        lower = 1.0 / upper if rs_lower is None else rs_lower
        judged = LEVELS[rs_level](log_ratio, mask)
        keep *= ((judged <= np.log(upper)) & (judged >= np.log(lower))).astype(np.float64)
    if veto_threshold is not None:
        vetoed = ((log_ratio < np.log(veto_threshold)) & (mask > 0)).any(-1, keepdims=True)
        keep *= 1.0 - vetoed
    weight = mask.copy()
    if is_level is not None:
        weight = np.minimum(np.exp(LEVELS[is_level](log_ratio, mask)), is_threshold) * mask
    ratio = np.exp(log_ratio)
    rows = mask.sum(-1) > 0
    kept_rows = keep.sum(-1) > 0
    sums = {"tokens": mask.sum(), "rows": float(rows.sum()),
            "log_ratio": (-log_ratio * mask).sum(),                # k1 of KL(pi_rollout || pi_old)
            "k3": ((ratio - 1.0 - log_ratio) * mask).sum(),        # k3 of the same, >= 0 token by token
            "weight": (weight * keep).sum(), "kept_tokens": keep.sum(),
            "rejected_tokens": (mask - keep).sum(), "rejected_rows": float((rows & ~kept_rows).sum()),
            "weight_max": float((weight * keep).max()) if keep.any() else 0.0,
            "ratio_max": float((ratio * mask).max()) if mask.any() else 0.0,
            "greedy_differs": float(((np.asarray(greedy[0]) != np.asarray(greedy[1])) * mask).sum())
            if greedy is not None else 0.0}
    return weight.astype(np.float32), keep.astype(np.float32), sums


GAP_METRICS = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/ratio/max",  # without any correction key
               "rollout_corr/greedy_differs")
SUMMED = ("tokens", "rows", "log_ratio", "k3", "weight", "kept_tokens", "rejected_tokens", "rejected_rows",
          "greedy_differs")


def correction_metrics(sums: dict, greedy: bool = False) -> dict:
    """Metrics from `rollout_correction`'s sums (already summed over ranks; the maxima already the largest);
    `greedy`: the sums hold the greedy choices' comparison (rollout_corr/greedy_differs)."""
    tokens, rows = max(sums["tokens"], 1.0), max(sums["rows"], 1.0)
    out = {"rollout_corr/kl": sums["log_ratio"] / tokens,
            "rollout_corr/k3_kl": sums["k3"] / tokens,
            "rollout_corr/is_weight_mean": sums["weight"] / max(sums["kept_tokens"], 1.0),
            "rollout_corr/is_weight/max": sums["weight_max"],
            "rollout_corr/ratio/max": sums["ratio_max"],
            "rollout_corr/rejected_token_share": sums["rejected_tokens"] / tokens,
            "rollout_corr/rejected_seq_share": sums["rejected_rows"] / rows}
    if greedy:
        out["rollout_corr/greedy_differs"] = sums["greedy_differs"] / tokens
    return out
