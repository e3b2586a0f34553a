"""Global (batch-wide) statistics: masked moments, whitening, running mean/variance.

`reduce` says who else holds part of the batch, and is always given by the caller (Objective gets it
from the trainer; there is no default group):
- None: this process holds the whole batch (no communication);
- a paddle.distributed group: the float64 sum over that group (the batch group, data x sharding ranks;
  never the world group, which also holds the tensor/pipeline copies of the same data);
- a callable `np.ndarray -> np.ndarray` returning the sum over ranks (tests fake ranks this way).
"""
import numpy as np
import paddle

from ..parallel.collectives import sum_numpy as group_sum  # float64 sum over a group (None: none)
from ._tensor import to_numpy


def global_sum(values, reduce) -> np.ndarray:
    """Sum of a float64 vector over the ranks `reduce` names (see the module docstring)."""
    if isinstance(reduce, str):
        raise ValueError(f"reduce: expected None, a process group or a callable, got {reduce!r} "
                         "(there is no default group: pass the batch group, or None for a whole batch)")
    values = np.asarray(values, dtype=np.float64)
    if callable(reduce):
        return np.asarray(reduce(values), dtype=np.float64)
    return group_sum(values, reduce)


def masked_moments(values, mask) -> np.ndarray:
    """[count, sum, sum of squares] of the entries where mask is 1 (this process only)."""
    v, m = to_numpy(values), to_numpy(mask)
    return np.array([m.sum(), (v * m).sum(), (v * v * m).sum()], dtype=np.float64)


def mean_var(moments, ddof: int = 1):
    """Mean and variance from [count, sum, sumsq]; variance 0 when count <= ddof."""
    count, total, squares = (float(x) for x in moments)
    if count <= 0:
        return 0.0, 0.0
    mean = total / count
    if count <= ddof:
        return mean, 0.0
    return mean, max(squares - count * mean * mean, 0.0) / (count - ddof)


def global_mean_var(values, mask=None, reduce=None, ddof: int = 1):
    """Masked mean and variance over every rank's entries."""
    values = to_numpy(values)
    mask = np.ones_like(values) if mask is None else to_numpy(mask)
    return mean_var(global_sum(masked_moments(values, mask), reduce), ddof)


def masked_whiten(values, mask, eps: float = 1e-8, shift_mean: bool = True, reduce=None):
    """(x - mean) * rsqrt(var + eps) over the masked entries of the whole batch (summed through `reduce`;
    None: these values are the whole batch); var unbiased.

    Returns the same kind as `values` (numpy array or float32 Paddle tensor), zero outside the mask.
    """
    is_tensor = isinstance(values, paddle.Tensor)
    v, m = to_numpy(values), to_numpy(mask)
    mean, var = global_mean_var(v, m, reduce)
    out = (v - mean) / np.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    out = np.where(m > 0, out, 0.0)
    return paddle.to_tensor(out.astype(np.float32)) if is_tensor else out


class RunningMoments:
    """Running mean and (unbiased) variance of a stream of batches, merged with Chan's formula."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    @property
    def var(self) -> float:
        return self.m2 / (self.count - 1) if self.count > 1 else 1.0

    @property
    def std(self) -> float:
        return float(np.sqrt(self.var))

    def update(self, values, reduce) -> None:
        """Fold in a batch (gathered over ranks through `reduce`)."""
        count, total, squares = global_sum(masked_moments(values, np.ones_like(to_numpy(values))), reduce)
        if count <= 0:
            return
        batch_mean = total / count
        batch_m2 = max(squares - count * batch_mean * batch_mean, 0.0)
        new_count = self.count + count
        delta = batch_mean - self.mean
        self.mean += delta * count / new_count
        self.m2 += batch_m2 + delta * delta * self.count * count / new_count
        self.count = new_count

    def state_dict(self) -> dict:
        return {"count": float(self.count), "mean": float(self.mean), "m2": float(self.m2)}

    def set_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
