"""Policy losses: per-token loss [B, T] and metrics (scalar tensors). Pure functions.

Every loss takes (logp, old_logp, advantages, mask) as tensors of one float dtype plus the options it
declares when registered, configuration keys declared here: clip_range_ratio_low, clip_range_ratio_high (ratio
clip 1-low .. 1+high; ppo, gspo, cispo; both default to clip_range_ratio), clip_ratio_c (ppo dual clip),
tau_pos, tau_neg (sapo). The ratio is exp(logp - old_logp) with the log-ratio clamped to [-20, 20].
"""
from typing import Optional

import paddle

from ..config.fields import above, at_least
from ..config.options import option
from ._tensor import as_tensor, metrics_to_floats
from .registry import Registry

POLICY_LOSSES = Registry("policy_loss", positional=4)   # (logp, old_logp, advantages, mask)
LOG_RATIO_CLAMP = 20.0


def _ratio_floor(key, value, config):
    low = CLIP_RANGE_RATIO_LOW.value(config)
    return None if low <= 1 else f"{key}: must be <= 1 (the ratio floor is 1 - clip), got {low}"


CLIP_RANGE_RATIO_LOW = option("clip_range_ratio_low", Optional[float], None, "Lower ratio clip (default "
                              "clip_range_ratio).", check=(at_least(0), _ratio_floor),
                              when_unset=lambda config: config.clip_range_ratio)
CLIP_RANGE_RATIO_HIGH = option("clip_range_ratio_high", Optional[float], None, "Upper ratio clip (default "
                               "clip_range_ratio; DAPO uses 0.28).", check=at_least(0),
                               when_unset=lambda config: config.clip_range_ratio)
CLIP_OPTIONS = (CLIP_RANGE_RATIO_LOW, CLIP_RANGE_RATIO_HIGH)


def register_policy_loss(name, options=(), **traits):
    """Register `fn(logp, old_logp, advantages, mask, *, <options>) -> (per-token loss, metrics)`; traits:
    loss_agg_mode (the aggregation it defaults to when loss_agg_mode is unset)."""
    return POLICY_LOSSES.register(name, options, **traits)


def masked_mean(x, mask):
    mask = mask.astype(x.dtype)
    return (x * mask).sum() / paddle.clip(mask.sum(), min=1.0)


def _fraction(condition, mask):
    return masked_mean(condition.astype(mask.dtype), mask)


def token_log_ratio(logp, old_logp):
    return paddle.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(ratio, advantages, low, high):
    unclipped = -advantages * ratio
    clipped = -advantages * paddle.clip(ratio, 1.0 - low, 1.0 + high)
    return paddle.maximum(unclipped, clipped)


def _clip_metrics(ratio, advantages, mask, low, high):
    return {
        "clipfrac_low": _fraction((ratio < 1.0 - low) & (advantages < 0), mask),
        "clipfrac_high": _fraction((ratio > 1.0 + high) & (advantages > 0), mask),
    }


@register_policy_loss("ppo", CLIP_OPTIONS + (
        option("clip_ratio_c", Optional[float], None, "Dual-clip bound for negative advantages (> 1, e.g. 3; "
               "policy_loss ppo).", check=above(1), error_when_unread=True),))
def ppo_loss(logp, old_logp, advantages, mask, clip_range_ratio_low: float = 0.2, clip_range_ratio_high: float = 0.2,
             clip_ratio_c=None):
    """max(-A r, -A clip(r, 1-low, 1+high)); dual clip: for A < 0 also min(., -A c)."""
    low, high = clip_range_ratio_low, clip_range_ratio_high
    ratio = token_log_ratio(logp, old_logp).exp()
    loss = _clipped_surrogate(ratio, advantages, low, high)
    with paddle.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, low, high)
        metrics["clipfrac_dual"] = paddle.zeros([], dtype=logp.dtype)
    if clip_ratio_c is not None:
        dual = paddle.minimum(loss, -advantages * clip_ratio_c)
        loss = paddle.where(advantages < 0, dual, loss)
        with paddle.no_grad():
            metrics["clipfrac_dual"] = _fraction((ratio > clip_ratio_c) & (advantages < 0), mask)
    return loss, metrics


def sequence_log_ratio(logp, old_logp, mask):
    """mean_t(logp - old_logp) over each sequence's tokens, [B, 1], clamped to [-20, 20]."""
    per_seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / paddle.clip(mask.sum(-1, keepdim=True), min=1.0)
    return paddle.clip(per_seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register_policy_loss("gspo", CLIP_OPTIONS, loss_agg_mode="seq-mean-token-mean")
def gspo_loss(logp, old_logp, advantages, mask, clip_range_ratio_low: float = 0.2, clip_range_ratio_high: float = 0.2):
    """Sequence-level ratio s_i = exp(mean_t(logp - old_logp)), applied per token as
    s_i,t = sg[s_i] * exp(logp - sg(logp)) and clipped like ppo."""
    seq_log_ratio = sequence_log_ratio(logp, old_logp, mask).detach()
    ratio = (seq_log_ratio + logp - logp.detach()).exp()
    loss = _clipped_surrogate(ratio, advantages, clip_range_ratio_low, clip_range_ratio_high)
    with paddle.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, clip_range_ratio_low, clip_range_ratio_high)
    return loss, metrics


@register_policy_loss("cispo", CLIP_OPTIONS)
def cispo_loss(logp, old_logp, advantages, mask, clip_range_ratio_low: float = 0.2, clip_range_ratio_high: float = 0.2):
    """-sg[clip(r, 1-low, 1+high)] * A * logp: every token keeps a (bounded) gradient."""
    low, high = clip_range_ratio_low, clip_range_ratio_high
    ratio = token_log_ratio(logp, old_logp).exp()
    weight = paddle.clip(ratio, 1.0 - low, 1.0 + high).detach()
    loss = -weight * advantages * logp
    with paddle.no_grad():
        metrics = {"clipfrac_low": _fraction(ratio < 1.0 - low, mask),
                   "clipfrac_high": _fraction(ratio > 1.0 + high, mask)}
    return loss, metrics


@register_policy_loss("sapo", (
        option("tau_pos", float, 1.0, "SAPO gate temperature for positive advantages.", check=above(0)),
        option("tau_neg", float, 1.05, "SAPO gate temperature for negative advantages.", check=above(0))))
def sapo_loss(logp, old_logp, advantages, mask, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """Soft gate instead of a clip: -f(r) A with f(r) = sigmoid(tau (r - 1)) * 4 / tau,
    tau = tau_pos where A > 0 and tau_neg elsewhere. f has slope 1 at r = 1, so on-policy the gradient
    is the plain policy gradient; far from r = 1 it fades smoothly."""
    ratio = token_log_ratio(logp, old_logp).exp()
    tau = paddle.where(advantages > 0, paddle.full_like(advantages, tau_pos), paddle.full_like(advantages, tau_neg))
    gate = paddle.nn.functional.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss = -gate * advantages
    with paddle.no_grad():
        zero = paddle.zeros([], dtype=logp.dtype)
        metrics = {"clipfrac_low": zero, "clipfrac_high": zero}
    return loss, metrics


def policy_loss(name, logp, old_logp, advantages, response_mask, **options):
    """Per-token loss [B, T] (in logp's dtype) and python-float metrics of the named policy loss.

    options: the ones the loss declares (POLICY_LOSSES[name].options); any other is a TypeError.

    Metrics (token means over this call's mask): clipfrac_low, clipfrac_high, clipfrac_dual,
    approx_kl (mean of (logp - old_logp)^2 / 2, to the rollout policy).
    """
    loss, metrics = policy_loss_tensors(name, logp, old_logp, advantages, response_mask, **options)
    return loss, metrics_to_floats(metrics)


def policy_loss_tensors(name, logp, old_logp, advantages, response_mask, **options):
    """policy_loss with the metrics as scalar tensors (one device sync later for all of them)."""
    loss_fn = POLICY_LOSSES.lookup(name)
    logp = as_tensor(logp)
    old_logp = logp.detach() if old_logp is None else as_tensor(old_logp, like=logp)
    advantages = as_tensor(advantages, like=logp)
    mask = as_tensor(response_mask, like=logp)
    loss, metrics = loss_fn(logp, old_logp, advantages, mask, **options)
    with paddle.no_grad():
        metrics.setdefault("clipfrac_dual", paddle.zeros([], dtype=logp.dtype))
        metrics["approx_kl"] = masked_mean(0.5 * token_log_ratio(logp, old_logp).square(), mask)
    return loss, metrics
