"""DAPO extras: soft overlong penalty, dynamic-sampling group filter, overlong filter. Pure numpy."""
import numpy as np
import paddle

from ._tensor import to_numpy
from .advantages import group_index

ZERO_VARIANCE_TOL = 1e-6


def soft_overlong_penalty(lengths, max_len: int, buffer: int, factor: float = 1.0) -> np.ndarray:
    """With L_exp = max_len - buffer: 0 if len <= L_exp, (L_exp - len) / buffer * factor inside the buffer,
    -factor beyond max_len.

    The one implementation of the penalty: the objective applies it under enable_overlong_reward_buffer and the
    soft_overlong reward function (paddle_rl/rewards/rules.py) calls it; paddle_rl.rewards.check_reward_config
    refuses both switches at once."""
    lengths = to_numpy(lengths)
    expected = max_len - buffer
    inside = (expected - lengths) / buffer * factor
    return np.where(lengths <= expected, 0.0, np.where(lengths <= max_len, inside, -factor))


def zero_variance_groups(scores, group_ids, tol: float = ZERO_VARIANCE_TOL):
    """Per-sample keep mask: False for groups of two or more whose score variance (population) <= tol.

    A group of one is kept (its advantage is its own score, not a comparison). Returns (keep, share of
    groups dropped).
    """
    s = to_numpy(scores)
    dense, n_groups = group_index(group_ids)
    keep = np.ones(len(s), dtype=bool)
    dropped = 0
    for g in range(n_groups):
        idx = dense == g
        if idx.sum() > 1 and s[idx].var() <= tol:
            keep[idx] = False
            dropped += 1
    return keep, (dropped / n_groups if n_groups else 0.0)


def overlong_filtered_mask(response_mask, truncated):
    """The response mask with every truncated response (hit max_dec_len without EOS) zeroed.

    Returns the same kind as response_mask (Paddle tensor of its dtype, or numpy array).
    """
    keep = ~to_numpy(truncated, dtype=bool).reshape(-1)
    if isinstance(response_mask, paddle.Tensor):
        rows = paddle.to_tensor(keep[:, None]).astype(response_mask.dtype)
        return response_mask * rows
    m = np.asarray(response_mask)
    return m * keep[:, None].astype(m.dtype)


def select_groups(keep, group_ids, target_groups: int, final_round: bool, fallback: str = "error"):
    """Sample indices of the training batch from the pool generated so far, or None to generate more.

    Groups are taken in order of first appearance: the first `target_groups` qualifying groups
    (keep True). When too few qualify and this was the last round (max_gen_batches reached):
    fallback "error" raises; "keep" fills up with non-qualifying groups (which carry no GRPO signal) so
    the batch keeps its size, or trains on what exists when even that is short.
    """
    keep = to_numpy(keep, dtype=bool).reshape(-1)
    ids = to_numpy(group_ids, dtype=None).reshape(-1)
    order, first = np.unique(ids, return_index=True)
    groups = order[np.argsort(first)]
    qualified = [g for g in groups if keep[ids == g].all()]
    if len(qualified) >= target_groups:
        chosen = qualified[:target_groups]
    elif not final_round:
        return None
    elif fallback == "error":
        raise RuntimeError(f"dynamic_sampling: only {len(qualified)} of {target_groups} prompt groups have "
                           f"non-zero score variance after max_gen_batches rounds; raise max_gen_batches, use "
                           f"easier prompts, or set dynamic_sampling_fallback: keep")
    elif fallback == "keep":
        rest = [g for g in groups if not keep[ids == g].all()]
        chosen = qualified + rest[:target_groups - len(qualified)]
    else:
        raise ValueError(f"dynamic_sampling_fallback: {fallback!r} is not one of error, keep")
    chosen = set(chosen)
    return np.array([i for i, g in enumerate(ids) if g in chosen], dtype=np.int64)
