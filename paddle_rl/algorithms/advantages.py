"""Advantage estimators: scores [B] (+ token data [B, T]) -> advantages [B, T]. Pure functions."""
import numpy as np
import paddle

from ._tensor import as_tensor

ADVANTAGE_ESTIMATORS = {}


def register_advantage(name):
    def wrap(fn):
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return wrap


def group_index(group_ids):
    """Group ids of any hashable kind -> dense int64 index [B] and the number of groups."""
    ids = group_ids.numpy() if isinstance(group_ids, paddle.Tensor) else np.asarray(group_ids)
    _, dense = np.unique(ids, return_inverse=True)
    return dense.reshape(-1), int(dense.max()) + 1 if dense.size else 0


def group_mean_std(scores, group_ids):
    """Per-sample mean and unbiased std of its group; a group of one gets mean 0, std 1."""
    dense, n_groups = group_index(group_ids)
    s = scores.numpy().astype(np.float64) if isinstance(scores, paddle.Tensor) else np.asarray(scores, np.float64)
    mean, std = np.zeros_like(s), np.ones_like(s)
    for g in range(n_groups):
        idx = dense == g
        if idx.sum() > 1:
            mean[idx] = s[idx].mean()
            std[idx] = s[idx].std(ddof=1)
    return mean, std


def masked_whiten(values, mask, eps: float = 1e-8):
    """(x - mean) * rsqrt(var + eps) over the masked entries; var unbiased."""
    mask = mask.astype(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / paddle.clip(count - 1, min=1.0)
    return (values - mean) * paddle.rsqrt(var + eps) * mask


@register_advantage("grpo")
def grpo_advantages(scores, response_mask, group_ids, eps: float = 1e-6, **_):
    mean, std = group_mean_std(scores, group_ids)
    s = as_tensor(scores).numpy().astype(np.float64)
    adv = ((s - mean) / (std + eps)).astype(np.float32)
    mask = as_tensor(response_mask)
    return paddle.to_tensor(adv).unsqueeze(-1) * mask


def discounted_returns(token_rewards, mask, gamma: float):
    """G_t = r_t + gamma * G_{t+1}, reset outside the mask. [B, T]."""
    rewards = (token_rewards * mask).numpy()
    m = mask.numpy()
    out = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running * m[:, t]
        running = running * m[:, t]
        out[:, t] = running
    return paddle.to_tensor(out)


def last_token_index(mask):
    m = mask.numpy()
    length = m.shape[1]
    return length - 1 - np.argmax(m[:, ::-1] > 0, axis=1)


@register_advantage("reinforce_plus_plus")
def reinforce_pp_advantages(scores, response_mask, group_ids=None, old_logp=None, ref_logp=None, kl_coeff: float = 0.0,
                            gamma: float = 1.0, clip_range_score: float = 10.0, whiten=masked_whiten, **_):
    mask = as_tensor(response_mask)
    rewards = paddle.zeros_like(mask)
    if kl_coeff and old_logp is not None and ref_logp is not None:
        rewards = -kl_coeff * (as_tensor(old_logp) - as_tensor(ref_logp)) * mask
    s = np.clip(as_tensor(scores).numpy(), -clip_range_score, clip_range_score)
    bonus = np.zeros(mask.shape, dtype=np.float32)
    bonus[np.arange(mask.shape[0]), last_token_index(mask)] = s
    rewards = rewards + paddle.to_tensor(bonus) * mask
    return whiten(discounted_returns(rewards, mask, gamma), mask)
