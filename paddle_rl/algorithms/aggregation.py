"""Loss aggregation with global normalizers, so micro-batch and rank splits give the same gradient.

Each mode returns this micro-batch's share of the mini-batch loss: summed over the micro-batches
(and data-parallel ranks) of a mini-batch it equals the loss of the whole mini-batch, provided
num_tokens / num_seqs are the mini-batch totals (see `loss_normalizers`).
"""
from typing import Optional

import numpy as np
import paddle

from ..config.fields import above
from ..config.options import option
from ._tensor import as_tensor, to_numpy
from .registry import Registry

LOSS_AGG_MODES = Registry("loss_agg_mode", positional=4)   # (loss, mask, num_tokens, num_seqs)
LOSS_SCALE_FACTOR = option("loss_scale_factor", Optional[float], None, "Divisor of seq-mean-token-sum-norm (default "
                           "max_dec_len).", check=above(0), when_unset=lambda config: float(config.max_dec_len))


def register_aggregation(name, options=()):
    return LOSS_AGG_MODES.register(name, options)


def loss_normalizers(response_mask):
    """(number of response tokens, number of sequences with at least one token) of a micro-batch.

    Sum these over the micro-batches of a mini-batch and over data-parallel ranks, then pass the totals
    as num_tokens / num_seqs. Sequences whose mask is all zero (e.g. the overlong filter) do not count.
    """
    m = to_numpy(response_mask)
    return float(m.sum()), float((m.sum(-1) > 0).sum())


def _scalar(value, like):
    return paddle.clip(paddle.to_tensor(float(value), dtype=like.dtype), min=1.0)


@register_aggregation("token-mean")
def token_mean(loss, mask, num_tokens, num_seqs):
    """sum(L m) / global token count."""
    return (loss * mask).sum() / _scalar(num_tokens, loss)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, num_tokens, num_seqs):
    """sum over sequences of (sequence token mean) / global sequence count."""
    per_seq = (loss * mask).sum(-1) / paddle.clip(mask.sum(-1), min=1.0)
    return per_seq.sum() / _scalar(num_seqs, loss)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, num_tokens, num_seqs):
    """sum over sequences of (sequence token sum) / global sequence count."""
    return (loss * mask).sum() / _scalar(num_seqs, loss)


@register_aggregation("seq-mean-token-sum-norm", (LOSS_SCALE_FACTOR,))
def seq_mean_token_sum_norm(loss, mask, num_tokens, num_seqs, loss_scale_factor: float = 1.0):
    """Dr.GRPO: sum(L m) / (global sequence count * loss_scale_factor)."""
    return (loss * mask).sum() / (_scalar(num_seqs, loss) * float(loss_scale_factor))


def aggregate_loss(per_token_loss, response_mask, mode: str = "token-mean", num_tokens=None, num_seqs=None,
                   loss_scale_factor=None):
    """This micro-batch's share of the mini-batch loss (a scalar in per_token_loss's dtype).

    num_tokens / num_seqs: mini-batch totals over all micro-batches and ranks; they default to this
    call's own counts, which makes the result the plain aggregate of this call. loss_scale_factor
    (seq-mean-token-sum-norm) defaults to the padded length T; pass a constant (max_dec_len) so the
    result does not depend on how the batch was padded or split.
    """
    aggregate = LOSS_AGG_MODES.lookup(mode)
    loss = as_tensor(per_token_loss)
    mask = as_tensor(response_mask, like=loss)
    local_tokens, local_seqs = loss_normalizers(mask) if num_tokens is None or num_seqs is None else (0, 0)
    num_tokens = local_tokens if num_tokens is None else num_tokens
    num_seqs = local_seqs if num_seqs is None else num_seqs
    factor = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return aggregate(loss, mask, _to_float(num_tokens), _to_float(num_seqs),
                     **aggregate.pick({"loss_scale_factor": factor}))


def _to_float(x) -> float:
    if isinstance(x, paddle.Tensor):
        return float(x.numpy())
    return float(np.asarray(x))
