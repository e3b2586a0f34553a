"""Policy losses: per-token loss [B, T] and metrics. Pure functions."""
import paddle

from ._tensor import as_tensor

POLICY_LOSSES = {}


def register_policy_loss(name):
    def wrap(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return wrap


def masked_mean(x, mask):
    return (x * mask).sum() / paddle.clip(mask.sum(), min=1.0)


@register_policy_loss("ppo")
def ppo_loss(logp, old_logp, advantages, response_mask, clip_low: float = 0.2, clip_high: float = 0.2, **_):
    log_ratio = paddle.clip(logp - old_logp, -20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * paddle.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = paddle.maximum(unclipped, clipped)
    mask = as_tensor(response_mask)
    with paddle.no_grad():
        metrics = {
            "clipfrac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).astype("float32"), mask),
            "clipfrac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).astype("float32"), mask),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
        }
    return loss, metrics


def policy_loss(name, logp, old_logp, advantages, response_mask, **options):
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss {name!r} (choose from {', '.join(POLICY_LOSSES)})")
    return POLICY_LOSSES[name](as_tensor(logp), as_tensor(old_logp), as_tensor(advantages), response_mask, **options)
