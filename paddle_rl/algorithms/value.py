"""The critic's side of PPO: the clipped value loss and the statistics of values against their returns.

value loss (per token) = 0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2), eps = clip_range_value,
with V the critic's current values, V_old its values at the rollout and R the returns (GAE advantages + V_old).
"""
import numpy as np
import paddle

from ._tensor import as_tensor, to_numpy
from .losses import masked_mean
from .stats import global_sum


def clipped_value_loss(values, old_values, returns, mask, clip_range_value: float):
    """(per-token loss [B, T] in values' dtype, metrics as scalar tensors: vf_loss, vpred_mean, vf_clipfrac).
    vf_clipfrac: the share of tokens where the value left the clip range and the clipped term is the larger one
    (the clip decided the loss)."""
    values = as_tensor(values)
    old_values, returns, mask = (as_tensor(x, like=values) for x in (old_values, returns, mask))
    clipped = old_values + paddle.clip(values - old_values, -clip_range_value, clip_range_value)
    plain_sq, clipped_sq = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * paddle.maximum(plain_sq, clipped_sq)
    with paddle.no_grad():
        # where the clip is not active the two terms differ by rounding only (old + (V - old) vs V): not counted
        decided = ((values - old_values).abs() > clip_range_value) & (clipped_sq > plain_sq)
        metrics = {"vf_loss": masked_mean(loss, mask), "vpred_mean": masked_mean(values, mask),
                   "vf_clipfrac": masked_mean(decided.astype(values.dtype), mask)}
    return loss, metrics


def value_statistics(values, returns, mask, reduce=None) -> dict:
    """Rollout-time values against their returns over every masked token of the global batch (summed through
    `reduce`): critic/vf_explained_var = 1 - Var(R - V) / Var(R) (0 when Var(R) is 0), critic/values_mean and
    critic/returns/{mean, std} (std over tokens, ddof 0)."""
    v, r, m = to_numpy(values), to_numpy(returns), to_numpy(mask) > 0
    v, r = v[m], r[m]
    d = r - v
    count, sr, sr2, sd, sd2, sv = global_sum([r.size, r.sum(), (r * r).sum(), d.sum(), (d * d).sum(), v.sum()],
                                             reduce)
    if count == 0:
        return {}
    var_r = max(sr2 / count - (sr / count) ** 2, 0.0)
    var_d = max(sd2 / count - (sd / count) ** 2, 0.0)
    return {"critic/vf_explained_var": float(1.0 - var_d / var_r) if var_r > 0 else 0.0,
            "critic/values_mean": float(sv / count), "critic/returns/mean": float(sr / count),
            "critic/returns/std": float(np.sqrt(var_r))}
