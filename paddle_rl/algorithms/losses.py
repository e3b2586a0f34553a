"""Policy losses: per-token loss [B, T] and metrics (scalar tensors). Pure functions.

Every loss takes (logp, old_logp, advantages, mask) as tensors of one float dtype plus the options it
declares when registered: clip_low, clip_high (ratio clip 1-clip_low .. 1+clip_high; ppo, gspo, cispo),
clip_ratio_c (ppo dual clip), tau_pos, tau_neg (sapo). The ratio is exp(logp - old_logp) with the
log-ratio clamped to [-20, 20].
"""
import paddle

from ._tensor import as_tensor, metrics_to_floats
from .registry import Registry

POLICY_LOSSES = Registry("policy_loss", positional=4)   # (logp, old_logp, advantages, mask)
LOG_RATIO_CLAMP = 20.0
CLIP_OPTIONS = ("clip_low", "clip_high")


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


def _clipped_surrogate(ratio, advantages, clip_low, clip_high):
    unclipped = -advantages * ratio
    clipped = -advantages * paddle.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return paddle.maximum(unclipped, clipped)


def _clip_metrics(ratio, advantages, mask, clip_low, clip_high):
    return {
        "clipfrac_low": _fraction((ratio < 1.0 - clip_low) & (advantages < 0), mask),
        "clipfrac_high": _fraction((ratio > 1.0 + clip_high) & (advantages > 0), mask),
    }


@register_policy_loss("ppo", CLIP_OPTIONS + ("clip_ratio_c",))
def ppo_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2, clip_high: float = 0.2,
             clip_ratio_c=None):
    """max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); dual clip: for A < 0 also min(., -A c)."""
    ratio = token_log_ratio(logp, old_logp).exp()
    loss = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    with paddle.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, clip_low, clip_high)
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
def gspo_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2, clip_high: float = 0.2):
    """Sequence-level ratio s_i = exp(mean_t(logp - old_logp)), applied per token as
    s_i,t = sg[s_i] * exp(logp - sg(logp)) and clipped like ppo."""
    seq_log_ratio = sequence_log_ratio(logp, old_logp, mask).detach()
    ratio = (seq_log_ratio + logp - logp.detach()).exp()
    loss = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    with paddle.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, clip_low, clip_high)
    return loss, metrics


@register_policy_loss("cispo", CLIP_OPTIONS)
def cispo_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2, clip_high: float = 0.2):
    """-sg[clip(r, 1-clip_low, 1+clip_high)] * A * logp: every token keeps a (bounded) gradient."""
    ratio = token_log_ratio(logp, old_logp).exp()
    weight = paddle.clip(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss = -weight * advantages * logp
    with paddle.no_grad():
        metrics = {"clipfrac_low": _fraction(ratio < 1.0 - clip_low, mask),
                   "clipfrac_high": _fraction(ratio > 1.0 + clip_high, mask)}
    return loss, metrics


@register_policy_loss("sapo", ("tau_pos", "tau_neg"))
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
